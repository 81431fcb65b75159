"""The answers to tasks 2.2a-c (``exercises/ring_collectives.py``): the textbook ring, ``minifsdp/comm/ring.py``."""

from minifsdp.comm.ring import ring_all_gather, ring_all_reduce, ring_reduce_scatter

__all__ = ["ring_reduce_scatter", "ring_all_gather", "ring_all_reduce"]
