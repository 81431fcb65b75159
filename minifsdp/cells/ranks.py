"""Two helpers for a notebook's ``%%ranks`` cells: print once, and a verdict that holds on every rank.

Every rank of a ``%%ranks`` cell runs the same code, so a plain ``print`` prints one line per rank,
grouped by rank in the cell's output.  For a line whose text is the same on every rank (a shape, a
verdict already agreed between the ranks) that is noise: :func:`show` prints it once, from rank 0.

A check such as ``torch.equal(ours, theirs)`` runs on each rank separately; rank 0 printing its own
``True`` says nothing about rank 1.  :func:`on_all_ranks` gathers every rank's answer (a collective:
every rank must call it, in the same order) and returns ``True`` only if all of them are true, so the
one line rank 0 prints is the verdict of all ranks.
"""

from __future__ import annotations

import torch.distributed as dist

__all__ = ["show", "on_all_ranks"]


def show(*args) -> None:
    """``print(*args)`` on rank 0 only: for lines that are the same on every rank."""
    if dist.get_rank() == 0:
        print(*args)


def on_all_ranks(flag) -> bool:
    """True only if ``flag`` holds on every rank (a collective: every rank calls it)."""
    flags = [None] * dist.get_world_size()
    dist.all_gather_object(flags, bool(flag))
    return all(flags)
