"""Project gradient accumulation under no_sync: see README.md beside this file."""
