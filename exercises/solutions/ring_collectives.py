"""The answers to tasks 2.2a-c (``exercises/ring_collectives.py``): the ring, on point-to-point messages only.

Rank r sends to r + 1 and receives from r - 1, both posted before either is waited on.  With chunk c of
rank r written ``c_r`` (chapter 2.2's picture, N = 3)::

    reduce-scatter, step s: r sends its running sum of chunk (r - s - 1) % N, receives chunk (r - s - 2) % N
                            and adds its own copy of it; after N - 1 steps the chunk received is chunk r
    all-gather,     step s: r sends chunk (r - s) % N (the one it completed last), receives chunk (r - s - 1) % N

Each chunk is summed in one order around the ring (rank c + 1's value, plus rank c + 2's, ..., plus the
owner's own last), as ``minifsdp/comm/ring.py`` does, so a run of FSDP on these functions is bitwise ours.
2.2c is the exercise's own (written for the learner), unchanged.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["ring_reduce_scatter", "ring_all_gather", "ring_all_reduce"]


def _exchange(group, send: torch.Tensor, recv: torch.Tensor) -> None:
    """One ring step: ``send`` to the next rank while ``recv`` arrives from the previous one."""
    g = group if group is not None else dist.group.WORLD
    rank, n = dist.get_rank(g), dist.get_world_size(g)
    works = []
    if send.numel():
        works.append(dist.isend(send, dist.get_global_rank(g, (rank + 1) % n), group=g))
    if recv.numel():
        works.append(dist.irecv(recv, dist.get_global_rank(g, (rank - 1) % n), group=g))
    for work in works:
        work.wait()


def ring_reduce_scatter(output: torch.Tensor, input: torch.Tensor, group=None) -> None:
    """Task 2.2a: rank r's ``output`` becomes the sum over ranks of their chunk r of ``input`` (left unchanged)."""
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    m = output.numel()
    chunks = input.reshape(n, m)
    received = [torch.empty(m, dtype=output.dtype, device=output.device) for _ in range(2)]
    running = chunks[(rank - 1) % n]  # step 0 sends our own chunk r - 1 as it is
    for step in range(n - 1):
        into = received[step % 2]  # the other buffer holds what we send now
        _exchange(group, running, into)
        running = into.add_(chunks[(rank - step - 2) % n])
    output.view(-1).copy_(running)  # after the last step: chunk r, summed over every rank


def ring_all_gather(output: torch.Tensor, input: torch.Tensor, group=None) -> None:
    """Task 2.2b: chunk c of ``output`` becomes rank c's ``input``, on every rank."""
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    chunks = output.view(n, -1)
    chunks[rank].copy_(input.reshape(-1))
    for step in range(n - 1):
        _exchange(group, chunks[(rank - step) % n], chunks[(rank - step - 1) % n])


def ring_all_reduce(tensor: torch.Tensor, group=None) -> None:
    """Task 2.2c (written for the learner): in-place sum over ranks = reduce-scatter, then all-gather."""
    n = dist.get_world_size(group)
    flat = tensor.reshape(-1)
    chunk = -(-flat.numel() // n)  # ceil(numel / N)
    padded = torch.zeros(chunk * n, dtype=tensor.dtype, device=tensor.device)
    padded[: flat.numel()] = flat
    mine = torch.empty(chunk, dtype=tensor.dtype, device=tensor.device)
    ring_reduce_scatter(mine, padded, group=group)
    ring_all_gather(padded, mine, group=group)
    tensor.copy_(padded[: flat.numel()].view_as(tensor))
