"""The ring: chunking, one step of send/receive, byte counting, and the two ring loops.

This is the engine under :mod:`minifsdp.comm.collectives` (chapter 2.2).  Nothing
here but ``dist.isend`` / ``dist.irecv`` and in-place adds.

The chunking rule (shared with :mod:`minifsdp.comm.ring_sim`): the flattened tensor
of S elements is cut into N chunks; the first ``S % N`` chunks get one extra
element (like ``torch.tensor_split``).  S=10, N=4 -> sizes 3,3,2,2.  When
S < N the last chunks are empty and their messages are simply not sent.

Ring all-reduce, N=3, chunks c0 c1 c2; ``a0`` = rank 0's c0, ``abc`` = sum::

  reduce-scatter: at step s, rank r sends chunk (r-s-1)%N to r+1, which adds it
  into its own copy.  After N-1 steps rank r holds the full sum of chunk r.

               rank 0          rank 1          rank 2
    start      a0 a1 a2        b0 b1 b2        c0 c1 c2
    step 0     r0 -a2-> r1     r1 -b0-> r2     r2 -c1-> r0
               a0 ac1 a2       b0 b1 ab2       bc0 c1 c2
    step 1     r0 -ac1-> r1    r1 -ab2-> r2    r2 -bc0-> r0
               abc0 ac1 a2     b0 abc1 ab2     bc0 c1 abc2      (rank r owns chunk r)

  all-gather: at step s, rank r sends chunk (r-s)%N to r+1, which stores it.
    step 0     r0 -abc0-> r1   r1 -abc1-> r2   r2 -abc2-> r0
    step 1     r0 -abc2-> r1   r1 -abc0-> r2   r2 -abc1-> r0
               every rank: abc0 abc1 abc2

Note (send and receive at once): in every step each rank posts ``isend`` to
the next rank *and* ``irecv`` from the previous one before waiting on either.
With blocking ``send`` then ``recv`` every rank would wait in ``send`` for a
receiver that is itself sending: the ring would deadlock (or serialise).
The all-reduce goes one better and posts every receive *early*: all of them,
before its first send.  Why it matters: gloo's send/recv over TCP is a
rendezvous -- a send whose receive is not posted yet only announces itself
("send ready"), and the bytes leave after the receiver answers "recv ready".
A receive posted early turns that into one trip.  But posting is itself a
message (the "recv ready" notice goes out at once), so "early" means early
within the collective: a collective's data receives are posted only once its
header has been read (comm/swap.py says what posting them before the header
cost).

Note (the header): before moving data every rank checks that all ranks called the same
collective on the same tensor shape, and at 2 ranks a small all-reduce rides in that
check's message: :mod:`minifsdp.comm.header`.

Note (pipelined pieces): a chunk larger than ``PIECE_BYTES`` moves as up to
``MAX_PIECES`` pieces; a rank adds (or forwards) piece j while piece j+1 is
still on the wire.  Receives are posted before the sends that feed them.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = [
    "chunk_bounds", "reduce_scatter_chunks", "all_gather_chunks", "ByteStats", "count_bytes", "active_stats",
    "Ring", "all_gather_in_place", "all_reduce_in_place",
]

OPS = {"sum": "sum", "avg": "avg"}
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16,
           torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8]
KINDS = ["all_reduce", "reduce_scatter", "all_gather", "naive_all_reduce"]
PIECE_BYTES = 1 << 20  # pipelined ring: each chunk moves in pieces of about this size ...
MAX_PIECES = 16  # ... but at most this many per chunk (every piece costs a few Python calls)


def chunk_bounds(numel: int, n: int) -> list[tuple[int, int]]:
    """(start, stop) of each of the ``n`` chunks of ``numel`` elements; the first ``numel % n`` are 1 longer."""
    base, extra = divmod(numel, n)
    bounds, start = [], 0
    for i in range(n):
        stop = start + base + (1 if i < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def reduce_scatter_chunks(rank: int, n: int, step: int) -> tuple[int, int]:
    """(chunk rank sends, chunk it receives and adds into) at reduce-scatter ``step``."""
    return (rank - step - 1) % n, (rank - step - 2) % n


def all_gather_chunks(rank: int, n: int, step: int) -> tuple[int, int]:
    """(chunk rank sends, chunk it receives and stores) at all-gather ``step``."""
    return (rank - step) % n, (rank - step - 1) % n


# ----------------------------------------------------------------------------- bytes
@dataclass(eq=False)  # identity, not value: count_bytes removes *its* counter on exit
class ByteStats:
    """Bytes this rank sent / received through our collectives, and how many messages."""

    sent: int = 0
    received: int = 0
    messages: int = 0


_ACTIVE_STATS: list[ByteStats] = []


@contextlib.contextmanager
def count_bytes():
    """Count the bytes of every collective issued inside the ``with`` block (nesting is fine)."""
    stats = ByteStats()
    _ACTIVE_STATS.append(stats)
    try:
        yield stats
    finally:
        _ACTIVE_STATS.remove(stats)


def active_stats() -> tuple[ByteStats, ...]:
    """The counters of every open ``count_bytes()`` block (a collective issued now adds to all of them)."""
    return tuple(_ACTIVE_STATS)


# ----------------------------------------------------------------------------- the ring
class _Nothing:
    """Stands in for the handle of an empty message, which is never sent."""

    def wait(self) -> bool:
        return True


_NOTHING = _Nothing()


class Ring:
    """This rank's seat in the ring of ``group``: its rank, neighbours, and byte counters."""

    def __init__(self, group, stats: tuple[ByteStats, ...], workspace: dict | None = None,
                 doorbells: dict | None = None):
        self.group = group
        self.workspace = {} if workspace is None else workspace  # tensors only (bench fsdp sums them)
        self.doorbells = {} if doorbells is None else doorbells
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.stats = stats
        self._global = {}  # group rank -> global rank, which isend/irecv expect

    def global_rank(self, group_rank: int) -> int:
        group_rank %= self.size
        if group_rank not in self._global:
            self._global[group_rank] = dist.get_global_rank(self.group, group_rank)
        return self._global[group_rank]

    def isend(self, tensor: torch.Tensor, to: int):
        """Start sending ``tensor`` to group rank ``to``; returns something to ``.wait()`` on."""
        for s in self.stats:
            s.sent += tensor.numel() * tensor.element_size()
            s.messages += bool(tensor.numel())
        if not tensor.numel():  # both ends know every chunk size, so both skip empty messages
            return _NOTHING
        return dist.isend(tensor, self.global_rank(to), group=self.group)

    def irecv(self, tensor: torch.Tensor, source: int):
        """Start receiving into ``tensor`` from group rank ``source``; returns something to ``.wait()`` on."""
        for s in self.stats:
            s.received += tensor.numel() * tensor.element_size()
        if not tensor.numel():
            return _NOTHING
        return dist.irecv(tensor, self.global_rank(source), group=self.group)

    def exchange(self, send: torch.Tensor, send_to: int, recv: torch.Tensor, recv_from: int) -> None:
        """Send ``send`` to group rank ``send_to`` while receiving ``recv`` from ``recv_from``; wait for both."""
        sending, receiving = self.isend(send, send_to), self.irecv(recv, recv_from)
        sending.wait()
        receiving.wait()

    def scratch(self, numel: int, like: torch.Tensor) -> torch.Tensor:
        """A reusable buffer of ``numel`` elements (dtype/device of ``like``) to receive into.

        Note (workspace): kept between collectives of the same group (one stream runs one
        collective at a time, so one buffer is enough): a fresh 32 MB buffer per call costs
        8192 page faults while the kernel copies into it.  It keeps the largest size asked for,
        until the process ends: (N-1)/N of the largest tensor all-reduced (the whole tensor at
        N=2, swapped: comm/swap.py), one chunk for a reduce-scatter (FSDP: one rank's shard of
        its largest unit).
        """
        key = (like.dtype, like.device)
        buf = self.workspace.get(key)
        if buf is None or buf.numel() < numel:
            buf = self.workspace[key] = torch.empty(numel, dtype=like.dtype, device=like.device)
        return buf[:numel]

    def step(self, send: torch.Tensor, recv: torch.Tensor) -> None:
        """One ring step: send to the next rank, receive from the previous one."""
        self.exchange(send, self.rank + 1, recv, self.rank - 1)


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

    def __init__(self, ring: Ring, flat: torch.Tensor, bounds, k: int):
        self.ring, self.flat, self.bounds, self.k = ring, flat, bounds, k
        self.inbox, self.receiving, self.sending = [], [], []

    def post(self) -> None:
        r, n = self.ring.rank, self.ring.size
        self.inbox = [_pieces(self.flat, self.bounds, all_gather_chunks(r, n, s)[1], self.k) for s in range(n - 1)]
        self.receiving = [[self.ring.irecv(p, r - 1) for p in step] for step in self.inbox]

    def send(self, piece: torch.Tensor) -> None:
        self.sending.append(self.ring.isend(piece, self.ring.rank + 1))

    def finish(self) -> None:
        n = self.ring.size
        for s in range(n - 1):
            for j, piece in enumerate(self.inbox[s]):
                self.receiving[s][j].wait()
                if s + 1 < n - 1:  # what arrived at step s is what we send at step s+1
                    self.send(piece)
        for work in self.sending:
            work.wait()


def all_gather_in_place(ring: Ring, flat: torch.Tensor, bounds, piece_bytes: int = 0) -> None:
    """Ring all-gather on ``flat``: rank r's chunk r is already in place; afterwards every chunk is."""
    if ring.size == 1:
        return
    gather = _Gather(ring, flat, bounds, pieces_of(bounds, piece_bytes or PIECE_BYTES, flat.element_size()))
    gather.post()
    for piece in _pieces(flat, bounds, ring.rank, gather.k):
        gather.send(piece)
    gather.finish()


def _rs_receives(ring: Ring, flat: torch.Tensor, bounds, k: int, s: int) -> list[tuple]:
    """Post reduce-scatter step ``s``'s receives into scratch slot ``s`` (one chunk wide; N-1 slots):
    (work, where it lands, piece of flat to add it into) for each of the ``k`` pieces (empty pieces
    are not sent, so not posted either)."""
    width = bounds[0][1] - bounds[0][0]  # chunk 0 is never shorter than the others
    slot = ring.scratch((ring.size - 1) * width, flat)[s * width : (s + 1) * width]
    into = _pieces(flat, bounds, reduce_scatter_chunks(ring.rank, ring.size, s)[1], k)
    inbox = slot[: sum(p.numel() for p in into)].split([p.numel() for p in into])
    return [(ring.irecv(box, ring.rank - 1), box, piece) for box, piece in zip(inbox, into)]


def all_reduce_in_place(ring: Ring, flat: torch.Tensor, op: str = "sum", piece_bytes: int = 0,
                        received: torch.Tensor | None = None) -> None:
    """Ring all-reduce of the 1-D ``flat``, in place: a reduce-scatter whose last step feeds an all-gather.

    At N=2 with ``received`` (the other rank's tensor, carried in its header: comm/header.py) it
    only adds: ``a + b`` on one rank and ``b + a`` on the other are the same bits (addition is
    commutative bitwise), so every rank holds the same result, as the ring guarantees.

    Every receive is posted before the first send: each reduce-scatter step receives into a
    scratch slot of its own (N-1 slots of one chunk: (N-1)/N of the tensor), and every
    all-gather piece lands in its final place in ``flat``.  Each piece is forwarded the moment
    it is added (pipelined: the next piece is on the wire while we add this one).  Why all at
    once: posting a receive sends the previous rank a notice (comm/swap.py), and posted in the
    middle of the collective that notice waits for the connection's lock while that rank's data
    streams in.  (Measured, 4 ranks, interleaved with gloo, five runs: at 4 MB 0.82-1.04x gloo's
    speed against 0.76-0.96x with two scratch halves used in turn, each step's receives posted
    during the step before; at 1 MB 1.26-1.57x against 1.03-1.38x; at 16 MB no difference.)

    Note (no seam between the halves): the reduce-scatter's last step sums our own chunk.
    Each piece of it, once added (and divided, for ``avg``), is already what the all-gather's
    step 0 sends, so it leaves at once, while the next piece is still arriving.  The
    all-gather's receives are posted right behind the reduce-scatter's, so the previous rank's
    all-gather data always finds them waiting.  Both halves use the same tag: the previous
    rank sends all its reduce-scatter pieces before any all-gather piece, and gloo matches a
    peer's messages on one tag in the order the receives were posted (posted before the
    reduce-scatter's, they would catch its data: tests/_workers_collectives.py hangs).  Safe to land
    early: the all-gather writes chunk c only after c's owner summed it, which needed every
    rank's reduce-scatter send of chunk c to have arrived.  (Measured before the receives were
    all posted up front, 4 ranks, 4 MB, interleaved with gloo in one run: 0.85 and 0.99x gloo's
    speed, against 0.75 and 0.80x with the all-gather started after the reduce-scatter.)

        N=2 (ring_all_reduce swaps there instead: comm/swap.py), rank 0 owns chunk 0; pieces
        p0 p1 of each chunk; a = ours, b = rank 1's, c = the sum:
          post   recv b0.p0 b0.p1 (into scratch slot 0), recv c1.p0 c1.p1 (into chunk 1)
          send   a1.p0 a1.p1                                  (rank 1 owns chunk 1)
          wait b0.p0, add -> c0.p0, send it | wait b0.p1, add -> c0.p1, send it
          wait c1.p0, c1.p1                                   (rank 1's sums)
    """
    n, r = ring.size, ring.rank
    if n == 2 and received is not None:
        flat.add_(received)
        if op == "avg":
            flat.div_(2)
        return
    if n == 1:
        return
    bounds = chunk_bounds(flat.numel(), n)
    k = pieces_of(bounds, piece_bytes or PIECE_BYTES, flat.element_size())
    steps = [_rs_receives(ring, flat, bounds, k, s) for s in range(n - 1)]  # every receive, in the order
    gather = _Gather(ring, flat, bounds, k)                                  # the previous rank sends
    gather.post()
    sending = [ring.isend(p, r + 1) for p in _pieces(flat, bounds, reduce_scatter_chunks(r, n, 0)[0], k)]
    for s, receiving in enumerate(steps):
        last = s == n - 2
        for work, box, piece in receiving:
            work.wait()
            piece.add_(box)
            if not last:  # step s+1 forwards the piece we just added into
                sending.append(ring.isend(piece, r + 1))
            else:  # summed over all ranks: the all-gather's step 0 sends it
                if op == "avg":  # divided once, by its owner, so every rank gets the same bits
                    piece.div_(n)
                gather.send(piece)
    for work in sending:
        work.wait()
    gather.finish()
