"""Reference solution of project-ac-budget (left out of the student edition): the fewest checkpointed blocks
that fit a memory budget, found by measuring.

The ruler (``exercises/projects/ac_budget/tower.py``'s ``run``) is the oracle, so the reference asks it, on a
fresh copy of the model each time:

1. every block checkpointed: if even that does not fit, nothing does (in this tower checkpointing one more
   block never raises the peak: measured over all 32 sets, though not a law for every model);
2. no block, then each single block, then pairs, ... (a smaller set first, so the first fit is a fewest);
   from size 2 on, the sets whose blocks saved the most alone are tried first.

A smarter policy predicts each set's peak from the blocks' saved activations and measures only to confirm.
Checkpointing is torch's non-reentrant ``torch.utils.checkpoint``: it replays the forward's RNG (dropout
masks) and needs no input that requires grad, so every gradient is bitwise the plain model's.
"""

from __future__ import annotations

import copy
import functools
import itertools

import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from exercises.projects.ac_budget.tower import run

__all__ = ["choose_blocks", "apply_checkpointing"]


def _blocks(model: nn.Module) -> list[str]:
    return [f"blocks.{i}" for i in range(len(model.blocks))]


def apply_checkpointing(model: nn.Module, names: list[str]) -> None:
    for name in names:
        block = model.get_submodule(name)
        block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)


def _peak(model: nn.Module, batch, names) -> int:
    trial = copy.deepcopy(model)
    apply_checkpointing(trial, list(names))
    return run(trial, batch)["peak"]


def choose_blocks(model: nn.Module, batch, budget_bytes: int) -> list[str]:
    names = _blocks(model)
    if _peak(model, batch, names) > budget_bytes:
        raise ValueError(f"no set of blocks fits {budget_bytes} bytes: even checkpointing every block peaks higher")
    plain = _peak(model, batch, [])
    if plain <= budget_bytes:
        return []
    saved = {}  # block -> bytes its checkpointing alone saves
    for name in names:
        saved[name] = plain - _peak(model, batch, [name])
        if plain - saved[name] <= budget_bytes:
            return [name]
    for size in range(2, len(names) + 1):
        subsets = sorted(itertools.combinations(names, size), key=lambda s: -sum(saved[n] for n in s))
        for subset in subsets:
            if _peak(model, batch, subset) <= budget_bytes:
                return list(subset)
    raise ValueError(f"no set of blocks fits {budget_bytes} bytes")
