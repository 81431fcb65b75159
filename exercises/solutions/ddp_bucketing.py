"""The answer to task 1.1 (``exercises/ddp_bucketing.py``): minifsdp's own bucketing, which DDP uses."""

from minifsdp.ddp.buckets import assign_buckets

__all__ = ["assign_buckets"]
