"""Project activation checkpointing under a memory budget: see README.md beside this file."""
