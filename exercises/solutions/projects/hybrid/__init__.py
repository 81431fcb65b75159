"""Reference solution of project-hybrid."""
