"""Project ZeRO-1: see README.md beside this file."""
