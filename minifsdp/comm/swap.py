"""Two ranks, an all-reduce too big to ride in the header: swap the whole tensor, then add.

Used by :func:`minifsdp.comm.collectives.ring_all_reduce` at N=2 for tensors above the carry
room (smaller ones travel inside the header message: comm/header.py).

Note (why a swap at two ranks): the ring at N=2 is one exchange each way per phase: send the
half the other rank owns, add the half it sends, then send back the summed half.  Swapping the
*whole* tensor once and adding sends the same bytes (2(N-1)/N x S = S) in one trip instead of
two, and both ranks compute ``a + b`` in the same order of operands for every element
(addition is commutative bitwise), so both hold the same bits, as the ring guarantees.  The
price is twice the adds (the whole tensor, not half).  Measured against the ring at N=2
(:func:`minifsdp.comm.ring.all_reduce_in_place`), both after the header, interleaved with
gloo (three runs, speed x gloo's): 2 MB swap 0.74-0.83, ring 0.69-0.77; 4 MB swap 0.76-0.79,
ring 0.64-0.79; 16 MB even (0.90-1.02 both).

Note (receives are posted after the header, not before): a gloo receive is not silent.
Posting one sends the peer a "ready to receive" notice on the connection (gloo's tcp
``Pair::recv``), and a send to a peer whose notice has arrived goes out at once.  Posted
*before* the header, these notices cross the header messages on the connection's lock
(comm/header.py, Note (who speaks first)); posted after it, both ranks have read every header
and the line is quiet.  Measured, 2 ranks, interleaved with gloo (three runs): 2 MB 0.73-0.80x
gloo's speed with the receives posted before the header, 0.87-1.22x after; 4 MB 0.64-0.75x
against 0.76-0.85x; 16 MB 0.77-0.83x against 0.82-0.89x.  And a mismatch needs no clean-up:
no data receive is posted until every rank knows the headers agree.
"""

from __future__ import annotations

import torch

from minifsdp.comm.ring import MAX_PIECES, PIECE_BYTES, Ring, chunk_bounds

__all__ = ["swap_sizes", "swap_all_reduce"]


def swap_sizes(numel: int, itemsize: int, piece_bytes: int = PIECE_BYTES) -> list[int]:
    """Element counts of the pieces a swap of ``numel`` elements moves in (all non-empty; none if 0)."""
    if numel <= 0:
        return []
    k = max(1, min(MAX_PIECES, numel, -(-numel * itemsize // piece_bytes)))
    return [b - a for a, b in chunk_bounds(numel, k)]


def swap_all_reduce(ring: Ring, flat: torch.Tensor, op: str = "sum") -> None:
    """N=2, in place: send ``flat`` to the other rank piece by piece, receive its tensor, add piece j as it lands.

    Called once the headers agree.  Receives go to the group's scratch buffer (kept between
    collectives: :meth:`Ring.scratch`), all posted before the first send, so each of the
    other rank's pieces finds its receive waiting; piece j+1 is on the wire while we add piece j.
    """
    sizes = swap_sizes(flat.numel(), flat.element_size())
    peer = ring.rank + 1
    inbox = ring.scratch(flat.numel(), flat).split(sizes)
    receiving = [ring.irecv(box, peer) for box in inbox]
    mine = flat.split(sizes)
    sending = [ring.isend(piece, peer) for piece in mine]
    for piece, box, sent, received in zip(mine, inbox, sending, receiving):
        sent.wait()  # piece j has left before we add into it
        received.wait()
        piece.add_(box)
    if op == "avg":
        flat.div_(2)
