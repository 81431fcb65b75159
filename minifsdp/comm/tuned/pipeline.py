"""The tuned ring's loops: chunks moved in pipelined pieces, every receive posted before the first send.

The schedule is the textbook's (:mod:`minifsdp.comm.ring`: the same chunks, the same "which chunk
at which step" functions, the same order of additions), so the bits are the same.  What changes
is *when* each message is posted, which on gloo decides how fast it goes:

Note (pipelined pieces): a chunk larger than ``PIECE_BYTES`` moves as up to ``MAX_PIECES`` pieces;
a rank adds (or forwards) piece j while piece j+1 is still on the wire.  Cutting a chunk in pieces
changes no sum: each element is still added once per step, in ring order.

Note (every receive posted before the first send): gloo's send/recv over TCP is a rendezvous -- a
send whose receive is not posted yet only announces itself, and the bytes leave after the receiver
answers.  A receive posted early turns that into one trip.  But posting is itself a message (a
"ready to receive" notice), and posted in the middle of the collective that notice waits for the
connection's lock while the previous rank's data streams in.  So the all-reduce posts all of its
receives at once, right after the header: each reduce-scatter step receives into a scratch slot of
its own (N-1 slots of one chunk: (N-1)/N of the tensor), and every all-gather piece lands in its
final place in ``flat``.

Note (no seam between the halves): the reduce-scatter's last step sums our own chunk.  Each piece
of it, once added (and divided, for ``avg``), is already what the all-gather's step 0 sends, so it
leaves at once, while the next piece is still arriving.  Both halves use the same tag: the previous
rank sends all its reduce-scatter pieces before any all-gather piece, and gloo matches a peer's
messages on one tag in the order the receives were posted (posted before the reduce-scatter's,
the all-gather's receives would catch its data and hang).  Safe to land early: the all-gather
writes chunk c only after c's owner summed it, which needed every rank's reduce-scatter send of
chunk c to have arrived.

    N=3, rank 0, pieces p0 p1 of each chunk; a = ours, s = partial sums, c = the full sum:
      post   recv s1.p0 s1.p1 (into slot 0), s0.p0 s0.p1 (into slot 1)   reduce-scatter, steps 0 and 1
             recv c2.p0 c2.p1, c1.p0 c1.p1 (into flat)                   all-gather, steps 0 and 1
      send   a2.p0 a2.p1
      step 0: wait s1.pj, add our a1.pj, send it         step 1: wait s0.pj, add a0.pj -> c0.pj, send it
      all-gather: wait c2.pj, forward it; wait c1.pj
"""

from __future__ import annotations

import torch

from minifsdp.comm.ring import all_gather_chunks, chunk_bounds, reduce_scatter_chunks
from minifsdp.comm.tuned.seat import Seat

__all__ = ["PIECE_BYTES", "MAX_PIECES", "pieces_of", "all_gather_in_place", "all_reduce_in_place",
           "reduce_scatter_into"]

PIECE_BYTES = 1 << 20  # each chunk moves in pieces of about this size ...
MAX_PIECES = 16  # ... but at most this many per chunk (every piece costs a few Python calls)


def pieces_of(bounds, piece_bytes: int, itemsize: int) -> int:
    """How many pieces each chunk is cut into: from chunk 0 (the longest) alone, so the same on every rank."""
    width = bounds[0][1] - bounds[0][0]
    return max(1, min(MAX_PIECES, -(-width * itemsize // piece_bytes)))


def _pieces(flat: torch.Tensor, bounds, c: int, k: int) -> list[torch.Tensor]:
    """Chunk ``c`` of ``flat`` cut into ``k`` pieces (the first ones one element longer; some may be empty)."""
    start, stop = bounds[c]
    return [flat[start + a : start + b] for a, b in chunk_bounds(stop - start, k)]


class _Gather:
    """A ring all-gather on ``flat`` in two calls: ``post()`` its receives, later ``finish()`` it.

    Every piece received lands in its own place in ``flat``, so all receives are posted at
    once, in the order the previous rank sends them.  Our own chunk's pieces go out through
    ``send(piece)``; ``finish()`` forwards each piece as soon as it has arrived (pipelined:
    piece j+1 is still on the wire while piece j is forwarded), then waits for every send.
    """

    def __init__(self, seat: Seat, flat: torch.Tensor, bounds, k: int):
        self.seat, self.flat, self.bounds, self.k = seat, flat, bounds, k
        self.inbox: list[list[torch.Tensor]] = []
        self.receiving: list[list] = []
        self.sending: list = []

    def post(self) -> None:
        r, n = self.seat.rank, self.seat.size
        self.inbox = [_pieces(self.flat, self.bounds, all_gather_chunks(r, n, s)[1], self.k) for s in range(n - 1)]
        self.receiving = [[self.seat.irecv(p, r - 1) for p in step] for step in self.inbox]

    def send(self, piece: torch.Tensor) -> None:
        self.sending.append(self.seat.isend(piece, self.seat.rank + 1))

    def finish(self) -> None:
        n = self.seat.size
        for s in range(n - 1):
            for j, piece in enumerate(self.inbox[s]):
                self.receiving[s][j].wait()
                if s + 1 < n - 1:  # what arrived at step s is what we send at step s+1
                    self.send(piece)
        for work in self.sending:
            work.wait()


def all_gather_in_place(seat: Seat, flat: torch.Tensor, bounds, piece_bytes: int = 0) -> None:
    """Ring all-gather on ``flat``: rank r's chunk r is already in place; afterwards every chunk is."""
    if seat.size == 1:
        return
    gather = _Gather(seat, flat, bounds, pieces_of(bounds, piece_bytes or PIECE_BYTES, flat.element_size()))
    gather.post()
    for piece in _pieces(flat, bounds, seat.rank, gather.k):
        gather.send(piece)
    gather.finish()


def _rs_receives(seat: Seat, flat: torch.Tensor, bounds, k: int, s: int) -> list[tuple]:
    """Post reduce-scatter step ``s``'s receives into scratch slot ``s`` (one chunk wide; N-1 slots):
    (work, where it lands, piece of flat to add it into) for each of the ``k`` pieces (empty pieces
    are not sent, so not posted either)."""
    width = bounds[0][1] - bounds[0][0]  # chunk 0 is never shorter than the others
    slot = seat.scratch((seat.size - 1) * width, flat)[s * width : (s + 1) * width]
    into = _pieces(flat, bounds, reduce_scatter_chunks(seat.rank, seat.size, s)[1], k)
    inbox = slot[: sum(p.numel() for p in into)].split([p.numel() for p in into])
    return [(seat.irecv(box, seat.rank - 1), box, piece) for box, piece in zip(inbox, into, strict=True)]


def all_reduce_in_place(seat: Seat, flat: torch.Tensor, op: str = "sum", piece_bytes: int = 0,
                        received: torch.Tensor | None = None) -> None:
    """Ring all-reduce of the 1-D ``flat``, in place: a reduce-scatter whose last step feeds an all-gather.

    At N=2 with ``received`` (the other rank's tensor, carried in its header: :mod:`.header`) it only
    adds, as the swap does (:mod:`.swap` says why that is the textbook's bits).
    """
    n, r = seat.size, seat.rank
    if n == 2 and received is not None:
        flat.add_(received)
        if op == "avg":
            flat.div_(2)
        return
    if n == 1:
        return
    bounds = chunk_bounds(flat.numel(), n)
    k = pieces_of(bounds, piece_bytes or PIECE_BYTES, flat.element_size())
    steps = [_rs_receives(seat, flat, bounds, k, s) for s in range(n - 1)]  # every receive, in the order
    gather = _Gather(seat, flat, bounds, k)                                  # the previous rank sends
    gather.post()
    sending = [seat.isend(p, r + 1) for p in _pieces(flat, bounds, reduce_scatter_chunks(r, n, 0)[0], k)]
    for s, receiving in enumerate(steps):
        last = s == n - 2
        for work, box, piece in receiving:
            work.wait()
            piece.add_(box)
            if not last:  # step s+1 forwards the piece we just added into
                sending.append(seat.isend(piece, r + 1))
            else:  # summed over all ranks: the all-gather's step 0 sends it
                if op == "avg":  # divided once, by its owner, so every rank gets the same bits
                    piece.div_(n)
                gather.send(piece)
    for work in sending:
        work.wait()
    gather.finish()


def reduce_scatter_into(seat: Seat, output: torch.Tensor, input: torch.Tensor, op: str) -> None:
    """Rank r's ``output`` (m elements) becomes the sum over ranks of chunk r of ``input`` (N x m).

    Partial sums in flight alternate between two buffers (we send one while receiving into the
    other): ``output`` itself and one scratch chunk, chosen so that the last step receives straight
    into ``output`` and adds our own chunk there.  So 2 ranks need no scratch and any more ranks
    one chunk of it: FSDP's peak holds no full-size copy of a unit's gradient for the ring.  (Unless
    ``output`` is a piece of ``input``: then receiving into it would overwrite a chunk not yet
    added, so two scratch chunks.)

        N=4: step 0 -> output, step 1 -> scratch, step 2 -> output (+ our chunk: done)
    """
    n, r, m = seat.size, seat.rank, output.numel()
    chunks = input.view(n, m)
    if n == 1:
        output.view(-1).copy_(chunks[0])
        return
    aliased = output.untyped_storage().data_ptr() == input.untyped_storage().data_ptr()
    out = output.view(-1)
    if aliased:
        scratch = seat.scratch(2 * m, input)
        into = [scratch[(s % 2) * m:(s % 2 + 1) * m] for s in range(n - 1)]
    else:
        scratch = seat.scratch(m, input) if n > 2 else None
        into = [out if (n - 2 - s) % 2 == 0 else scratch for s in range(n - 1)]
    sending = chunks[reduce_scatter_chunks(r, n, 0)[0]]
    for s, received in enumerate(into):
        recv_c = reduce_scatter_chunks(r, n, s)[1]
        seat.step(sending, received)
        if recv_c == r:  # the last step: our chunk, once added, is summed over all ranks
            torch.add(received, chunks[r], out=out)  # received + own: the textbook's order
        else:
            sending = received.add_(chunks[recv_c])
    if op == "avg":
        output.div_(n)
