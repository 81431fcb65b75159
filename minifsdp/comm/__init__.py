"""Chapter 2.2: collectives written by hand on point-to-point messages.

Read in this order:

    ring.py         the textbook ring: chunks, reduce-scatter, all-gather, all-reduce, byte counting
                    (the reference the ring exercises compare with)
    ring_sim.py     the same schedule simulated in one process, every message recorded (for pictures)
    naive.py        the parameter-server shape, for contrast: one root receives everything
    checks.py       what every collective checks first: bad input, and the same call on every rank
    counting.py     count_bytes(): the bytes our collectives moved
    stream.py       one background thread per group, so asynchronous collectives keep their order
    collectives.py  get_collectives("ring" | "textbook" | "torch"): which ones FSDP and DDP run
    tuned/          going deeper: the same ring tuned for gloo (headers, doorbells, swap, pieces),
                    bitwise the textbook's results; get_collectives("ring")

Nothing here knows about models: FSDP and DDP call these with flat tensors.
"""

from minifsdp.comm.collectives import (
    COLLECTIVE_KINDS,
    count_bytes,
    get_collectives,
    naive_all_reduce,
    ring_all_gather,
    ring_all_reduce,
    ring_reduce_scatter,
)

__all__ = ["naive_all_reduce", "ring_all_reduce", "ring_reduce_scatter", "ring_all_gather", "count_bytes",
           "get_collectives", "COLLECTIVE_KINDS"]
