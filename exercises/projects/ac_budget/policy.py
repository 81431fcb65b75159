"""Project activation checkpointing under a memory budget (``project-ac-budget``).

The goal, the oracle and the hints: ``exercises/projects/ac_budget/README.md``.  Grade with::

    pytest tests/exercises/projects/test_ac_budget.py --impl=student

Write the two functions; add whatever helpers you like in this file.  The model and the ruler the tests
measure with are in ``exercises/projects/ac_budget/tower.py``.
"""

from __future__ import annotations

import torch.nn as nn

from exercises.projects.ac_budget.tower import run  # noqa: F401 - the ruler

__all__ = ["choose_blocks", "apply_checkpointing"]


def apply_checkpointing(model: nn.Module, names: list[str]) -> None:
    """Checkpoint the blocks named ``names`` (e.g. ``["blocks.0", "blocks.3"]``) of ``model``, in place: their
    activations are recomputed in the backward instead of kept.  Every gradient must stay what the plain
    model's is, bit for bit."""
    raise NotImplementedError("project-ac-budget: apply_checkpointing -- see exercises/projects/ac_budget/README.md")


def choose_blocks(model: nn.Module, batch, budget_bytes: int) -> list[str]:
    """The fewest blocks whose checkpointing makes ``run(model, batch)["peak"] <= budget_bytes``; their names.

    ``model`` is a plain ``Tower`` (no block checkpointed); leave it as you found it.  If no set of blocks fits,
    raise ValueError.
    """
    raise NotImplementedError("project-ac-budget: choose_blocks -- see exercises/projects/ac_budget/README.md")
