"""Reference solution of project-zero1."""
