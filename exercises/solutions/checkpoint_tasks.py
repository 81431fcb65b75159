"""The answers to tasks 4.3a-b (``exercises/checkpoint_tasks.py``): a checkpoint as pieces of parameters.

Both are one piece of arithmetic: which part of a run of numbers lies inside a window.  The flat buffer lays
the parameters end to end; rank r's window is numbers ``[r * S, (r + 1) * S)`` with ``S = ceil(total / N)``.
Saving cuts each parameter by the window; loading cuts each saved piece by the new window.
"""

from __future__ import annotations

import math

import torch

__all__ = ["save_pieces", "load_shard"]


def _inside(start: int, numel: int, lo: int, hi: int) -> tuple[int, int] | None:
    """The part of ``[start, start + numel)`` inside ``[lo, hi)``, as flat positions, or None."""
    a, b = max(start, lo), min(start + numel, hi)
    return (a, b) if a < b else None


def _layout(numels: list[tuple[str, int]]) -> list[tuple[str, int, int]]:
    out, start = [], 0
    for name, numel in numels:
        out.append((name, start, numel))
        start += numel
    return out


def save_pieces(shard: torch.Tensor, numels: list[tuple[str, int]], world_size: int, rank: int) -> dict:
    """Task 4.3a: ``{name: (lo, hi, numbers)}`` for every parameter this rank's shard holds numbers of."""
    size = math.ceil(sum(n for _, n in numels) / world_size)
    if shard.numel() != size:
        raise ValueError(f"rank {rank}'s shard should hold {size} numbers, got {shard.numel()}")
    window = rank * size
    pieces = {}
    for name, start, numel in _layout(numels):
        part = _inside(start, numel, window, window + size)
        if part is not None:
            a, b = part
            pieces[name] = (a - start, b - start, shard[a - window: b - window].clone())
    return pieces


def load_shard(saved: list[dict], numels: list[tuple[str, int]], world_size: int, rank: int) -> torch.Tensor:
    """Task 4.3b: rank ``rank``'s shard at ``world_size`` ranks, zeros where the buffer is padding."""
    size = math.ceil(sum(n for _, n in numels) / world_size)
    window = rank * size
    dtype = next((t.dtype for pieces in saved for (_, _, t) in pieces.values()), torch.float32)
    out = torch.zeros(size, dtype=dtype)
    for name, start, _ in _layout(numels):
        for pieces in saved:
            if name in pieces:
                lo, hi, numbers = pieces[name]
                part = _inside(start + lo, hi - lo, window, window + size)
                if part is not None:
                    a, b = part
                    out[a - window: b - window] = numbers[a - start - lo: b - start - lo]
    return out
