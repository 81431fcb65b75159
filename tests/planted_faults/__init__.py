"""Planted faults: realistic bugs planted in the library in memory, each caught by a named test (see plant.py)."""
