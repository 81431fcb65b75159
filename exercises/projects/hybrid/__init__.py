"""Project HYBRID_SHARD: see README.md beside this file."""
