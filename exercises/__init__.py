"""Classroom exercises: fill in the stubs, then grade with `pytest tests/exercises --impl=student`."""
