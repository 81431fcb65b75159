"""Data receives posted *before* the header exchange, and what happens to them on a mismatch.

Used by :func:`minifsdp.comm.collectives.ring_all_reduce`: at N=2 for tensors too big to ride in
the header message (more than ``carry_room(ring)``; smaller ones are carried: comm/header.py), the
whole swap (:class:`EarlyExchange`); at N > 2 the ring's step 0 (:class:`minifsdp.comm.ring.RingAllReduce`).

Note (speculative receive): gloo's send/recv is a rendezvous, and on a loaded 2-core machine a
receive posted at about the moment the other rank's message arrives can cost a whole scheduler
tick (~4 ms; header.py, Note (doorbell)).  After the header exchange both ranks post their data
receive and send at once, so each data message races its receive.  But every rank must pass a
tensor of the same size and dtype, so a rank already knows what it will receive *before* it
knows the headers agree: it posts the data receives first, then sends its header.  The peer
sends data only after it has read that header, so the data always finds its receive posted.

Note (what the tick really was, measured): timing each call inside a slow 256 KB swap showed
the ~4 ms mostly inside the ``dist.isend`` *call* (and sometimes the ``irecv`` call), not in
``wait()``: both ranks send at once, and each one's call waits for the connection's lock,
held by gloo's event thread while it reads the peer's incoming bytes -- on 2 busy cores that
thread may be descheduled holding it.  Posting early helps only a little (noisy).  What helps
clearly is fewer messages: ``CARRY_BYTES`` became 1 MB (was 128 KB), so up to 1 MB an
all-reduce is one message each way, the header's (bench, N=2: 256 KB ~3 ms -> ~0.8-1.1 ms).

Note (a mismatch): if the headers disagree no data is sent, but a receive posted early is
still waiting, and it would swallow the next message.  Each rank knows from the next rank's
header whether (and how many) receives that rank posted early (:func:`early_receives`), so it
sends that many one-byte fillers (gloo accepts a message shorter than the receive), waits for
its own receives to be filled the same way, and only then raises.  Both ranks raise the same
``ValueError``, and nothing is left posted.  The swap has its own tag (``SWAP_TAG``): its
fillers and data never meet headers or the ring's messages; the ring's step-0 fillers use the
ring's data tag, and are the only message on it before the error.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from minifsdp.comm.ring import (
    DTYPES,
    KINDS,
    MAX_PIECES,
    PIECE_BYTES,
    Ring,
    chunk_bounds,
    pieces_of,
    reduce_scatter_chunks,
)

__all__ = ["SWAP_TAG", "swap_sizes", "early_numel", "early_receives", "EarlyExchange", "fill_early_receives"]

SWAP_TAG = 0x6D67  # the tag of the two-rank swap's data (and of mismatch fillers)


def swap_sizes(numel: int, itemsize: int, piece_bytes: int = PIECE_BYTES) -> list[int]:
    """Element counts of the pieces an exchange of ``numel`` elements moves in (all non-empty; none if 0)."""
    if numel <= 0:
        return []
    k = max(1, min(MAX_PIECES, numel, -(-numel * itemsize // piece_bytes)))
    return [b - a for a, b in chunk_bounds(numel, k)]


def early_numel(kind: str, numel: int, itemsize: int, room: int) -> int:
    """Elements a rank receives early at N=2 for collective ``kind`` on a header tensor of ``numel`` (0: none).

    Only an all-reduce above ``room``, the carry room both ranks agreed on (smaller ones ride in the
    header message: comm/header.py).  Reduce-scatter and all-gather could do the same, but measured
    no clear gain (see the commit message), so they don't.
    """
    return numel if kind == "all_reduce" and numel * itemsize > room else 0


def early_receives(row: list[int], room: int, n: int, rank: int) -> tuple[int, int]:
    """(how many receives, on which tag) group rank ``rank`` of ``n``, whose header row is ``row``, posted
    early from the rank before it, given the carry room: the swap's at N=2, step 0 of a ring all-reduce
    at N > 2 (:class:`minifsdp.comm.ring.RingAllReduce`); (0, 0) for any other collective."""
    itemsize = DTYPES[row[2]].itemsize
    if n == 2:
        return len(swap_sizes(early_numel(KINDS[row[0]], row[1], itemsize, room), itemsize)), SWAP_TAG
    if KINDS[row[0]] != "all_reduce":
        return 0, 0
    bounds = chunk_bounds(row[1], n)
    start, stop = bounds[reduce_scatter_chunks(rank, n, 0)[1]]
    k = pieces_of(bounds, PIECE_BYTES, itemsize)
    return sum(1 for a, b in chunk_bounds(stop - start, k) if b > a), 0


class EarlyExchange:
    """N=2: receives into ``inbox`` posted at construction (before the header), then ``run()`` or ``cancel()``."""

    def __init__(self, ring: Ring, inbox: torch.Tensor, room: int):
        self.ring, self.peer, self.room = ring, ring.global_rank(ring.rank + 1), room
        self.sizes = swap_sizes(inbox.numel(), inbox.element_size())
        self.inbox = inbox.split(self.sizes)
        self.receiving = [dist.irecv(t, self.peer, group=ring.group, tag=SWAP_TAG) for t in self.inbox]

    def run(self, outbox: torch.Tensor, arrived=None) -> None:
        """The headers agree: send ``outbox`` piece by piece; ``arrived(j, sent, got)`` as piece j lands.

        ``sent`` (our piece j) has left by then, so ``arrived`` may write into it.
        """
        nbytes = outbox.numel() * outbox.element_size()
        for s in self.ring.stats:
            s.sent, s.received, s.messages = s.sent + nbytes, s.received + nbytes, s.messages + len(self.sizes)
        mine = outbox.split(self.sizes)
        sending = [dist.isend(m, self.peer, group=self.ring.group, tag=SWAP_TAG) for m in mine]
        for j, (m, t, sent, received) in enumerate(zip(mine, self.inbox, sending, self.receiving)):
            sent.wait()
            received.wait()
            if arrived is not None:
                arrived(j, m, t)

    def cancel(self, rows: list[list[int]]) -> None:
        """The headers disagree: fill the peer's early receives with one-byte messages; wait for ours."""
        fill_early_receives(self.ring, rows, self.room)
        for work in self.receiving:  # the peer fills them the same way
            work.wait()


def fill_early_receives(ring: Ring, rows: list[list[int]], room: int) -> None:
    """On a mismatch: fill what the next rank posted early (if anything), known from its header row and
    the carry room (every rank computed the same ``room`` before the headers: comm/header.py)."""
    after = (ring.rank + 1) % ring.size
    count, tag = early_receives(rows[after], room, ring.size, after)
    filler = torch.zeros(1, dtype=torch.uint8)
    sending = [dist.isend(filler, ring.global_rank(after), group=ring.group, tag=tag) for _ in range(count)]
    for work in sending:
        work.wait()
