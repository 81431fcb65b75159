"""Tasks 4.3a-b: save a sharded checkpoint as pieces, load it at another world size.

Fill in :func:`save_pieces` (4.3a) and :func:`load_shard` (4.3b).  The task text and
hints are in ``exercises/README_checkpoint.md``.  Grade with::

    pytest tests/exercises/test_checkpoint_exercises.py --impl=student

No process group is needed: each function is what *one* rank does with its own
shard (4.3a) or with the files every rank wrote (4.3b).

Reference solution: ``save_pieces`` / ``load_shard`` in ``minifsdp/checkpoint/pieces.py`` (and
``exercises/solutions/checkpoint_tasks.py``); do not peek before you have tried.
"""

from __future__ import annotations

import torch


def save_pieces(shard: torch.Tensor, numels: list[tuple[str, int]], world_size: int, rank: int) -> dict:
    """Task 4.3a.  The pieces of original parameters that rank ``rank``'s flat shard holds.

    Args:
        shard: this rank's 1-D shard: numbers ``[rank * S, (rank + 1) * S)`` of the flat
            buffer, where ``S = ceil(total / world_size)`` and the buffer is padded with zeros
            to ``world_size * S``.
        numels: the parameters in flat order, ``[(name, numel), ...]``; parameter ``i`` starts
            at the sum of the numels before it (no gaps).
        world_size, rank: the layout the shard comes from.

    Returns:
        ``{name: (lo, hi, numbers)}`` for every parameter with at least one number in this
        shard: ``numbers`` is a *copy* (1-D, ``hi - lo`` long) of numbers ``[lo, hi)`` of that
        parameter, flattened.  Padding is never saved; a parameter with no number here is absent.
    """
    raise NotImplementedError("Task 4.3a: save_pieces -- see exercises/README_checkpoint.md")


def load_shard(saved: list[dict], numels: list[tuple[str, int]], world_size: int, rank: int) -> torch.Tensor:
    """Task 4.3b.  Rank ``rank``'s shard at a *new* world size, from pieces saved at any world size.

    Args:
        saved: one dict per rank of the run that saved (any number of them), each as
            :func:`save_pieces` returns it.
        numels: the parameters in flat order, as in 4.3a.
        world_size, rank: the new layout.

    Returns:
        A 1-D tensor of ``ceil(total / world_size)`` numbers: numbers
        ``[rank * S, (rank + 1) * S)`` of the flat buffer, with zeros where the buffer is padding.
        Its dtype is the saved numbers' dtype.
    """
    raise NotImplementedError("Task 4.3b: load_shard -- see exercises/README_checkpoint.md")
