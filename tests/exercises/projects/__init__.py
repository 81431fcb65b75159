"""The graded tests of the course's projects (exercises/projects/), and their rank functions."""
