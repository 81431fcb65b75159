"""Going deeper (chapter 2.2): the textbook ring, tuned for gloo -- the same bits, fewer waits.

:mod:`minifsdp.comm.ring` is the algorithm.  On gloo over TCP most of its time goes not to
moving bytes but to waiting: every send is a rendezvous with its receive, a receive posted late
costs a round trip, messages that cross on one connection wait for its lock.  This package keeps
the textbook's schedule and order of additions (so its results are bitwise the textbook's) and
changes when each message is posted.  ``get_collectives("ring")`` is this one.  Read in this order:

    seat.py         this rank's place in the ring: neighbours, byte counters, buffers kept between calls
    header.py       the same-call check in 2(N-1) messages, its receive posted one collective early
                    (a doorbell), and at 2 ranks a small all-reduce carried inside it
    swap.py         2 ranks, an all-reduce too big to carry: swap the whole tensor and add
    pipeline.py     the ring's loops: pipelined pieces, every receive posted before the first send
    collectives.py  ring_all_reduce / ring_reduce_scatter / ring_all_gather with async_op

What each choice bought, measured against gloo: ``chapters/results/ring_going_deeper.md``.
"""

from minifsdp.comm.tuned.collectives import ring_all_gather, ring_all_reduce, ring_reduce_scatter

__all__ = ["ring_all_reduce", "ring_reduce_scatter", "ring_all_gather"]
