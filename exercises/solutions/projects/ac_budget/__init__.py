"""Reference solution of project-ac-budget."""
