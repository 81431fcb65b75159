"""Chapter 2.2: collectives written by hand on point-to-point messages.

    ring.py         the ring itself: chunk bounds, one send/receive step, byte counting
    header.py       the check every collective starts with (same call on every rank?), its receives
                    posted ahead, and the small all-reduce carried inside it at 2 ranks
    swap.py         2 ranks, an all-reduce too big for the header: swap the whole tensor and add
    collectives.py  naive and ring all-reduce, ring reduce-scatter / all-gather, and
                    ``get_collectives("ring" | "torch")``: ours or torch.distributed's behind one interface
    stream.py       one background thread per group, so asynchronous collectives keep their order
    ring_sim.py     the ring all-reduce simulated in one process, step by step (for pictures)

Nothing here knows about models: FSDP and DDP call these with flat tensors.
"""

from minifsdp.comm.collectives import (
    count_bytes,
    get_collectives,
    naive_all_reduce,
    ring_all_gather,
    ring_all_reduce,
    ring_reduce_scatter,
)

__all__ = ["naive_all_reduce", "ring_all_reduce", "ring_reduce_scatter", "ring_all_gather", "count_bytes",
           "get_collectives"]
