"""The answers to tasks 5.1-5.2 (``exercises/fsdp2_tasks.py``): FSDP2's per-parameter layout.

Rank r of N holds rows ``[r * c, min((r + 1) * c, d0))`` of a parameter of ``d0`` rows, ``c = ceil(d0 / N)``
(torch FSDP2's documented rule, ``torch.chunk(tensor, N, dim=0)[r]``), in a chunk padded with zero rows to
``c``; what the user sees (``to_local()``) is the unpadded rows, a view of that chunk.  The all-gather of a
group concatenates each rank's padded chunks, flattened; the copy-out cuts every parameter's columns out of
each rank's row and drops the padding rows.  minifsdp's ``FSDPParam`` (``minifsdp/fsdp2/param.py``) does
the same inside ``fully_shard``.
"""

from __future__ import annotations

import math

import torch

__all__ = ["shard_rows", "copy_out"]


def shard_rows(tensor: torch.Tensor, rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Task 5.1: ``(padded, local)``, ``local`` a view of ``padded``."""
    d0, rest = tensor.shape[0], tuple(tensor.shape[1:])
    c = math.ceil(d0 / world_size)
    lo, hi = min(rank * c, d0), min((rank + 1) * c, d0)
    padded = tensor.new_zeros((c, *rest))
    padded[: hi - lo].copy_(tensor[lo:hi])
    return padded, padded[: hi - lo]


def copy_out(gathered: torch.Tensor, shapes: list[torch.Size]) -> list[torch.Tensor]:
    """Task 5.2: one full tensor per shape from a group's ``(N, total)`` all-gathered buffer."""
    n, out, offset = gathered.shape[0], [], 0
    for shape in shapes:
        d0, rest = shape[0], tuple(shape[1:])
        c = math.ceil(d0 / n)
        numel = c * math.prod(rest)
        rows = gathered[:, offset: offset + numel].reshape(n * c, *rest)  # rank 0's chunk, rank 1's, ...
        out.append(rows[:d0].clone())
        offset += numel
    return out
