"""Chapter 2.2: the ring -- reduce-scatter, all-gather and all-reduce, on point-to-point messages only.

Each rank sends only to the next rank and receives only from the previous one::

    rank 0 --> rank 1 --> ... --> rank N-1 --> rank 0

Chunks: the flattened tensor of S elements is cut into N chunks, the first ``S % N`` one element
longer (as ``torch.tensor_split`` does): S=10, N=4 -> 3,3,2,2.  When S < N the last chunks are
empty; both ends know every size, so an empty message is simply not sent.

All-reduce = reduce-scatter, then all-gather.  N=3, chunks c0 c1 c2, ``a0`` = rank 0's c0, ``abc`` = sum::

  reduce-scatter: at step s, rank r sends chunk (r-s-1)%N to r+1, which adds its own copy to it.
               rank 0          rank 1          rank 2
    start      a0 a1 a2        b0 b1 b2        c0 c1 c2
    step 0     r0 -a2-> r1     r1 -b0-> r2     r2 -c1-> r0
               a0 ac1 a2       b0 b1 ab2       bc0 c1 c2
    step 1     r0 -ac1-> r1    r1 -ab2-> r2    r2 -bc0-> r0
               abc0 ac1 a2     b0 abc1 ab2     bc0 c1 abc2      (rank r owns chunk r: the full sum)
  all-gather: at step s, rank r sends chunk (r-s)%N to r+1, which stores it.
    step 0     r0 -abc0-> r1   r1 -abc1-> r2   r2 -abc2-> r0
    step 1     r0 -abc2-> r1   r1 -abc0-> r2   r2 -abc1-> r0
               every rank: abc0 abc1 abc2

Bytes: each phase sends N-1 chunks per rank, so an all-reduce sends 2(N-1)/N x S bytes per rank,
nearly S whatever N is.  With uneven chunks rank r never sends chunk r in the reduce-scatter nor
chunk r+1 in the all-gather: it sends 2S - |c_r| - |c_r+1| elements.  ``count_bytes`` counts them.

Note (send and receive at once): in every step each rank posts ``isend`` to the next rank *and*
``irecv`` from the previous one before waiting on either.  With a blocking ``send`` first, every
rank would wait for a receiver that is itself sending: the ring would deadlock.

Note (the same bits on every rank): chunk c is summed in one order, around the ring (rank c+1's
value, plus rank c+2's, ..., plus rank c's own last), and divided once (``avg``) by its owner;
the all-gather only copies.  So all ranks hold the same bits.  gloo adds in another order: fp16,
bf16 (and fp32 random data at N > 2) may differ from ``dist.all_reduce`` in the last bits.

This is the reference the ring exercises compare with.  :mod:`minifsdp.comm.tuned` moves the same
bytes faster on gloo and gives bitwise the same results; ``get_collectives("textbook")`` lets FSDP
and DDP run on this one (``"ring"`` is the tuned one).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from minifsdp.comm.checks import agree_on_call, check_ready, check_sizes
from minifsdp.comm.counting import active_stats, count_bytes

__all__ = ["chunk_bounds", "reduce_scatter_chunks", "all_gather_chunks", "ring_step", "count_bytes",
           "ring_reduce_scatter", "ring_all_gather", "ring_all_reduce"]


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
    """(chunk ``rank`` sends, chunk it receives and adds its own to) at reduce-scatter ``step``."""
    return (rank - step - 1) % n, (rank - step - 2) % n


def all_gather_chunks(rank: int, n: int, step: int) -> tuple[int, int]:
    """(chunk ``rank`` sends, chunk it receives and stores) at all-gather ``step``."""
    return (rank - step) % n, (rank - step - 1) % n


def ring_step(group, send: torch.Tensor, recv: torch.Tensor) -> None:
    """One step: send ``send`` to the next rank while receiving ``recv`` from the previous one; wait for both."""
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    for stats in active_stats():
        stats.add(sent=send.numel() * send.element_size(), received=recv.numel() * recv.element_size(),
                  messages=int(send.numel() > 0))
    works = []
    if send.numel():  # isend/irecv take the peer's *global* rank
        works.append(dist.isend(send, dist.get_global_rank(group, (rank + 1) % n), group=group))
    if recv.numel():
        works.append(dist.irecv(recv, dist.get_global_rank(group, (rank - 1) % n), group=group))
    for work in works:
        work.wait()


def _chunks(flat: torch.Tensor, n: int) -> list[torch.Tensor]:
    return [flat[start:stop] for start, stop in chunk_bounds(flat.numel(), n)]


# >>> student edition: cut; exercises/ring_collectives.py runs here (tasks 2.2a-c)
def _reduce_scatter(group, chunks: list[torch.Tensor], out: torch.Tensor) -> None:
    """``out`` (rank r's) becomes the sum over ranks of their ``chunks[r]``; ``chunks`` are only read.

    Two buffers take turns: we send the running sum in one while receiving into the other."""
    r, n = dist.get_rank(group), len(chunks)
    buffers = out.new_empty((2, max(c.numel() for c in chunks)))
    sending = chunks[reduce_scatter_chunks(r, n, 0)[0]]  # step 0 sends our own chunk r-1 as it is
    for step in range(n - 1):
        c = reduce_scatter_chunks(r, n, step)[1]
        received = buffers[step % 2, : chunks[c].numel()]
        ring_step(group, sending, received)
        sending = received.add_(chunks[c])  # the running sum of chunk c: what we send at step + 1
    out.copy_(sending)  # after the last step, c == r: our chunk, summed over every rank


def _all_gather(group, chunks: list[torch.Tensor]) -> None:
    """``chunks[r]`` holds rank r's part on rank r; afterwards every rank holds every chunk."""
    r, n = dist.get_rank(group), len(chunks)
    for step in range(n - 1):
        send, recv = all_gather_chunks(r, n, step)
        ring_step(group, chunks[send], chunks[recv])


def ring_reduce_scatter(output: torch.Tensor, input: torch.Tensor, op="sum", group=None) -> None:
    """Like ``dist.reduce_scatter_tensor``: ``input`` holds N x output.numel() elements; rank r's
    ``output`` becomes the sum (or mean) over ranks of chunk r of ``input``.  ``input`` is not modified."""
    group, op = check_ready("ring_reduce_scatter", group, {"output": output, "input": input}, op)
    n = check_sizes("ring_reduce_scatter", input, output, group)
    agree_on_call(group, "reduce_scatter", input, op)
    _reduce_scatter(group, _chunks(input.view(-1), n), output.view(-1))
    if op == "avg":
        output.div_(n)


def ring_all_gather(output: torch.Tensor, input: torch.Tensor, group=None) -> None:
    """Like ``dist.all_gather_into_tensor``: ``output`` (N x input.numel() elements) becomes every
    rank's ``input``, concatenated in rank order."""
    group, _ = check_ready("ring_all_gather", group, {"output": output, "input": input})
    n = check_sizes("ring_all_gather", output, input, group)
    agree_on_call(group, "all_gather", input, "sum")
    chunks = _chunks(output.view(-1), n)
    chunks[dist.get_rank(group)].copy_(input.view(-1))
    _all_gather(group, chunks)


def ring_all_reduce(tensor: torch.Tensor, op="sum", group=None) -> None:
    """In place: every rank's ``tensor`` (any shape, any size) becomes the sum (or mean) over ranks."""
    group, op = check_ready("ring_all_reduce", group, {"tensor": tensor}, op)
    agree_on_call(group, "all_reduce", tensor, op)
    n, r = dist.get_world_size(group), dist.get_rank(group)
    chunks = _chunks(tensor.view(-1), n)
    _reduce_scatter(group, chunks, chunks[r])  # rank r now owns chunk r, summed
    if op == "avg":
        chunks[r].div_(n)  # divided once, by its owner: every rank gets the same bits
    _all_gather(group, chunks)
# <<< student edition
