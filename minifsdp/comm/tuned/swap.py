"""Two ranks, an all-reduce too big to ride in the header: swap the whole tensor, then add.

Used by :func:`minifsdp.comm.tuned.collectives.ring_all_reduce` at N=2 for tensors above the carry
room (smaller ones travel inside the header message: :mod:`.header`).

Note (why a swap at two ranks): the ring at N=2 is one exchange each way per phase: send the
half the other rank owns, add the half it sends, then send back the summed half.  Swapping the
*whole* tensor once and adding sends the same bytes (2(N-1)/N x S = S) in one trip instead of
two.  Same bits as the textbook ring: there, chunk c is ``own + received`` on its owner, then
copied; here both ranks compute ``a + b`` for every element, and ``a + b`` and ``b + a`` are the
same bits (addition is commutative in floating point too; it is *association* that is not).  For
``avg`` both divide that sum by 2, as the owner would.  The price is twice the adds.

Note (receives are posted after the header, not before): a gloo receive is not silent.  Posting
one sends the peer a "ready to receive" notice on the connection (gloo's tcp ``Pair::recv``), and
a send to a peer whose notice has arrived goes out at once.  Posted *before* the header, these
notices cross the header messages on the connection's lock (:mod:`.header`, Note (who speaks
first)); posted after it, both ranks have read every header and the line is quiet.  And a
mismatch needs no clean-up: no data receive is posted until every rank knows the headers agree.
"""

from __future__ import annotations

import torch

from minifsdp.comm.ring import chunk_bounds
from minifsdp.comm.tuned.pipeline import MAX_PIECES, PIECE_BYTES
from minifsdp.comm.tuned.seat import Seat

__all__ = ["swap_sizes", "swap_all_reduce"]


def swap_sizes(numel: int, itemsize: int, piece_bytes: int = PIECE_BYTES) -> list[int]:
    """Element counts of the pieces a swap of ``numel`` elements moves in (all non-empty; none if 0)."""
    if numel <= 0:
        return []
    k = max(1, min(MAX_PIECES, numel, -(-numel * itemsize // piece_bytes)))
    return [b - a for a, b in chunk_bounds(numel, k)]


def swap_all_reduce(seat: Seat, flat: torch.Tensor, op: str = "sum") -> None:
    """N=2, in place: send ``flat`` to the other rank piece by piece, receive its tensor, add piece j as it lands.

    Called once the headers agree.  Receives go to the group's scratch buffer (kept between
    collectives: :meth:`Seat.scratch`), all posted before the first send, so each of the
    other rank's pieces finds its receive waiting; piece j+1 is on the wire while we add piece j.
    """
    sizes = swap_sizes(flat.numel(), flat.element_size())
    peer = seat.rank + 1
    inbox = seat.scratch(flat.numel(), flat).split(sizes)
    receiving = [seat.irecv(box, peer) for box in inbox]
    mine = flat.split(sizes)
    sending = [seat.isend(piece, peer) for piece in mine]
    for piece, box, sent, received in zip(mine, inbox, sending, receiving, strict=True):
        sent.wait()  # piece j has left before we add into it
        received.wait()
        piece.add_(box)
    if op == "avg":
        flat.div_(2)
