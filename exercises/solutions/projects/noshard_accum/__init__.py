"""Reference solution of project-noshard-accum."""
