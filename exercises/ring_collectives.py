"""Tasks 2.2a-c: a ring reduce-scatter and a ring all-gather, by hand; an all-reduce from the two.

Fill in :func:`ring_reduce_scatter` (2.2a) and :func:`ring_all_gather` (2.2b).
:func:`ring_all_reduce` (2.2c) is already written from those two: it passes once
they do.  The task text and hints are in ``exercises/README_ring.md``.  Grade with::

    pytest tests/exercises/test_ring_exercises.py --impl=student

Then run it inside a real FSDP training run, compared bitwise with ours::

    python -m minifsdp train --impl student --student 2.2 --steps 8

Only ``dist.isend`` / ``dist.irecv`` (and ``.wait()``) are allowed for moving data;
``dist.all_reduce`` and friends are what you are rebuilding.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def ring_reduce_scatter(output: torch.Tensor, input: torch.Tensor, group=None) -> None:
    """Task 2.2a.  Sum over ranks, keep chunk ``r`` on rank ``r`` (like ``dist.reduce_scatter_tensor``).

    Args:
        output: this rank's result, ``m`` elements (contiguous).  Overwritten.
        input: ``N * m`` elements on every rank (N = world size of ``group``), seen as
            N chunks of ``m``: chunk ``c`` is ``input.view(-1)[c*m:(c+1)*m]``.  Do not modify it.
        group: the process group (None: all ranks).

    Afterwards, on rank ``r``: ``output == sum over ranks of their input chunk r``.
    Do it in N-1 ring steps, each sending a running sum to rank ``r + 1`` and receiving one from
    rank ``r - 1``; which chunk when is yours to read off the picture (README_ring.md's questions).
    """
    raise NotImplementedError("Task 2.2a: ring_reduce_scatter -- see exercises/README_ring.md")


def ring_all_gather(output: torch.Tensor, input: torch.Tensor, group=None) -> None:
    """Task 2.2b.  Concatenate every rank's ``input`` in rank order (like ``dist.all_gather_into_tensor``).

    Args:
        output: ``N * m`` elements (contiguous).  Overwritten: chunk ``c`` becomes rank ``c``'s input.
        input: this rank's ``m`` elements.
        group: the process group (None: all ranks).

    Do it in N-1 ring steps: put your own input in chunk ``r`` of ``output``; then every chunk
    travels once around the ring, received straight into ``output`` (which chunk when: the picture).
    """
    raise NotImplementedError("Task 2.2b: ring_all_gather -- see exercises/README_ring.md")


def ring_all_reduce(tensor: torch.Tensor, group=None) -> None:
    """Task 2.2c (written for you): in-place sum over ranks = reduce-scatter, then all-gather.

    ``tensor`` may have any size: we pad the flattened tensor with zeros up to a multiple
    of N (zeros do not change a sum), reduce-scatter it so rank r owns the summed chunk r,
    all-gather the chunks back, and drop the padding.  (minifsdp's own version avoids the
    padding copy with uneven chunks; see minifsdp/comm/ring.py.)
    """
    n = dist.get_world_size(group)
    flat = tensor.reshape(-1)
    chunk = -(-flat.numel() // n)  # ceil(numel / N)
    padded = torch.zeros(chunk * n, dtype=tensor.dtype, device=tensor.device)
    padded[: flat.numel()] = flat
    mine = torch.empty(chunk, dtype=tensor.dtype, device=tensor.device)
    ring_reduce_scatter(mine, padded, group=group)
    ring_all_gather(padded, mine, group=group)
    tensor.copy_(padded[: flat.numel()].view_as(tensor))
