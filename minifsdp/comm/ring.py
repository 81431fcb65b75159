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
The loops go one better and post receives *early* (all of them for the
all-gather, the next one for the reduce-scatter).  Why it matters: gloo's
send/recv over TCP is a rendezvous -- a send whose receive is not posted yet
only announces itself ("send ready"), and the bytes leave after the receiver
answers "recv ready".  A receive posted early turns that into one trip.

Note (same shapes everywhere): before moving data, every rank sends a tiny
header (collective, element count, dtype, op) to every other rank and compares;
if any rank differs, *every* rank raises the same ``ValueError`` listing all
ranks.  Without it gloo would abort the process on a size mismatch or hang.
It costs one round trip of N-1 tiny messages (not counted by ``count_bytes``).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = [
    "chunk_bounds", "reduce_scatter_chunks", "all_gather_chunks", "ByteStats", "count_bytes", "active_stats",
    "Ring", "all_gather_in_place", "reduce_scatter_in_place", "agree_on_header",
]

OPS = {"sum": "sum", "avg": "avg"}
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16,
           torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8]
KINDS = ["all_reduce", "reduce_scatter", "all_gather", "naive_all_reduce"]


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

    def __init__(self, group, stats: tuple[ByteStats, ...], workspace: dict | None = None):
        self.group = group
        self.workspace = {} if workspace is None else workspace
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
        8192 page faults while the kernel copies into it.  It keeps the largest size asked for
        (two chunks: 2/N of the largest tensor all-reduced), until the process ends.
        """
        key = (like.dtype, like.device)
        buf = self.workspace.get(key)
        if buf is None or buf.numel() < numel:
            buf = self.workspace[key] = torch.empty(numel, dtype=like.dtype, device=like.device)
        return buf[:numel]

    def step(self, send: torch.Tensor, recv: torch.Tensor) -> None:
        """One ring step: send to the next rank, receive from the previous one."""
        self.exchange(send, self.rank + 1, recv, self.rank - 1)


def all_gather_in_place(ring: Ring, flat: torch.Tensor, bounds) -> None:
    """Ring all-gather on ``flat``: rank r's chunk r is already in place; afterwards every chunk is.

    Every chunk received lands in its own place in ``flat``, so all N-1 receives are posted
    up front; then each step forwards the chunk that arrived in the step before.
    """
    n, r = ring.size, ring.rank

    def chunk(c: int) -> torch.Tensor:
        return flat[slice(*bounds[c])]

    prev, next = r - 1, r + 1
    receiving = [ring.irecv(chunk(all_gather_chunks(r, n, s)[1]), prev) for s in range(n - 1)]
    sending = []
    for s in range(n - 1):
        if s > 0:
            receiving[s - 1].wait()  # the chunk to forward now is the one received at step s-1
        sending.append(ring.isend(chunk(all_gather_chunks(r, n, s)[0]), next))
    for work in receiving[-1:] + sending:
        work.wait()


def reduce_scatter_in_place(ring: Ring, flat: torch.Tensor, bounds) -> None:
    """Ring reduce-scatter on ``flat``: afterwards chunk r of rank r holds the sum over ranks.

    Receives go to two scratch halves used in turn, so the receive of step s+1 is already
    posted while we add the chunk of step s; that sum is what we send at step s+1.
    """
    n, r = ring.size, ring.rank
    if n == 1:
        return
    width = bounds[0][1] - bounds[0][0]  # chunk 0 is never shorter than the others
    scratch = ring.scratch(2 * width, flat)
    inbox = [scratch[:width], scratch[width:]]

    def chunk(c: int) -> torch.Tensor:
        return flat[slice(*bounds[c])]

    def post_receive(s: int):
        size = chunk(reduce_scatter_chunks(r, n, s)[1]).numel()
        return ring.irecv(inbox[s % 2][:size], r - 1)

    receiving = post_receive(0)
    sending = ring.isend(chunk(reduce_scatter_chunks(r, n, 0)[0]), r + 1)
    for s in range(n - 1):
        recv_c = reduce_scatter_chunks(r, n, s)[1]
        receiving.wait()
        if s + 1 < n - 1:  # the other half is free again: its data was added at step s-1
            receiving = post_receive(s + 1)
        into = chunk(recv_c)
        into.add_(inbox[s % 2][: into.numel()])
        sending.wait()
        if s + 1 < n - 1:
            sending = ring.isend(into, r + 1)  # step s+1 forwards the chunk we just added into


def agree_on_header(ring: Ring, kind: str, tensor: torch.Tensor, op: str, extra: int = 0) -> None:
    """Every rank tells every other rank (collective, numel, dtype, op, extra); all check they agree.

    Not a ring: for 5 numbers latency is all that matters, so each rank sends its row
    straight to each other rank, all at once: one round trip instead of N-1 ring steps.
    Control traffic: its bytes are not counted by ``count_bytes`` (that counts the data).
    """
    mine = [KINDS.index(kind), tensor.numel(), DTYPES.index(tensor.dtype), list(OPS).index(op), extra]
    table = torch.zeros(ring.size, len(mine), dtype=torch.int64, device=tensor.device)
    table[ring.rank] = torch.tensor(mine)
    quiet = Ring(ring.group, stats=())
    others = [i for i in range(ring.size) if i != ring.rank]
    works = [quiet.irecv(table[i], i) for i in others] + [quiet.isend(table[ring.rank], i) for i in others]
    for work in works:
        work.wait()
    rows = table.tolist()
    if any(row != rows[0] for row in rows):
        lines = [
            f"  rank {i}: {KINDS[k]}, {numel} elements of {DTYPES[d]}, op={list(OPS)[o]}, root={e}"
            for i, (k, numel, d, o, e) in enumerate(rows)
        ]
        raise ValueError(
            f"{kind}: the ranks called different collectives or passed different tensors:\n" + "\n".join(lines)
            + "\nEvery rank must call the same collective with a tensor of the same size and dtype, and the same op."
        )
