"""Two ranks: the all-reduce's data receive is posted *before* the header exchange.

Used by :func:`minifsdp.comm.collectives.ring_all_reduce` at N=2 for tensors too big to ride
in the header message (more than ``CARRY_BYTES``); smaller ones are carried (ring.py).

Note (speculative receive): gloo's send/recv is a rendezvous, and on a loaded 2-core machine a
receive posted at about the moment the other rank's message arrives can cost a whole scheduler
tick (~4 ms; ring.py, Note (doorbell)).  After the header exchange both ranks post their data
receive and send at once, so each data message races its receive.  But every rank must pass a
tensor of the same size and dtype, so a rank already knows what it will receive *before* it
knows the headers agree: it posts the data receives first, then sends its header.  The peer
sends data only after it has read that header, so the data always finds its receive posted
(the fast path).  Measured at 256 KB and 1 MB: see the commit message.

Note (a mismatch): if the headers disagree no data is sent, but a receive posted early is
still waiting, and it would swallow the peer's next message.  Each rank knows from the peer's
header whether (and how many) receives the peer posted early (:func:`early_receives`), so it
sends that many one-byte fillers (gloo accepts a message shorter than the receive), waits for
its own receives to be filled the same way, and only then raises.  Both ranks raise the same
``ValueError``, and nothing is left posted.  Own tag (``SWAP_TAG``): fillers and data never
meet headers or the ring's messages.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from minifsdp.comm.ring import CARRY_BYTES, DTYPES, KINDS, MAX_PIECES, PIECE_BYTES, Ring, chunk_bounds

__all__ = ["SWAP_TAG", "swap_sizes", "early_receives", "EarlySwap", "fill_peer_receives"]

SWAP_TAG = 0x6D67  # the tag of the two-rank swap's data (and of mismatch fillers)


def swap_sizes(numel: int, itemsize: int, piece_bytes: int = PIECE_BYTES) -> list[int]:
    """Element counts of the pieces the swap moves ``numel`` elements in (every piece non-empty)."""
    k = max(1, min(MAX_PIECES, numel, -(-numel * itemsize // piece_bytes)))
    return [b - a for a, b in chunk_bounds(numel, k)]


def early_receives(row: list[int]) -> int:
    """How many receives a rank whose header row is ``row`` posted early (0: it uses no early swap)."""
    kind, numel, dtype = row[0], row[1], DTYPES[row[2]]
    if KINDS[kind] != "all_reduce" or numel * dtype.itemsize <= CARRY_BYTES:
        return 0
    return len(swap_sizes(numel, dtype.itemsize))


class EarlySwap:
    """N=2 all-reduce data: receives posted at construction (before the header), then ``run()`` or ``cancel()``."""

    def __init__(self, ring: Ring, flat: torch.Tensor):
        self.ring, self.flat, self.peer = ring, flat, ring.global_rank(ring.rank + 1)
        self.sizes = swap_sizes(flat.numel(), flat.element_size())
        self.theirs = ring.scratch(flat.numel(), flat).split(self.sizes)
        self.receiving = [dist.irecv(t, self.peer, group=ring.group, tag=SWAP_TAG) for t in self.theirs]

    def run(self) -> None:
        """The headers agree: send ours piece by piece and add theirs as each arrives."""
        nbytes = self.flat.numel() * self.flat.element_size()
        for s in self.ring.stats:
            s.sent, s.received, s.messages = s.sent + nbytes, s.received + nbytes, s.messages + len(self.sizes)
        mine = self.flat.split(self.sizes)
        sending = [dist.isend(m, self.peer, group=self.ring.group, tag=SWAP_TAG) for m in mine]
        for m, t, sent, received in zip(mine, self.theirs, sending, self.receiving):
            sent.wait()  # piece m is still being read by the send: add into it only once that is done
            received.wait()
            m.add_(t)

    def cancel(self, rows: list[list[int]]) -> None:
        """The headers disagree: fill the peer's early receives with one-byte messages; wait for ours."""
        fill_peer_receives(self.ring, rows)
        for work in self.receiving:  # the peer fills them the same way
            work.wait()


def fill_peer_receives(ring: Ring, rows: list[list[int]]) -> None:
    """A rank that posted nothing early, on a mismatch: fill what the peer posted early (if anything)."""
    other = (ring.rank + 1) % 2
    filler = torch.zeros(1, dtype=torch.uint8)
    sending = [dist.isend(filler, ring.global_rank(other), group=ring.group, tag=SWAP_TAG)
               for _ in range(early_receives(rows[other]))]
    for work in sending:
        work.wait()
