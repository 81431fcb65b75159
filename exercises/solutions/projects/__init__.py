"""The reference solutions of the course's projects (left out of the student edition)."""
