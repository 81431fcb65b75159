"""Project ac-budget's model and ruler (given code: the tests use it as it is; not a part of your answer).

The model is a tower of residual blocks of different widths, each with dropout, on one process::

    x (64 x 32) -> block 0 -> block 1 -> ... -> block 4 -> head -> (64 x 1) -> mean squared error
    block i:  x + dropout(fc2(gelu(fc1(layer_norm(x)))))      fc1: 32 -> HIDDEN[i], fc2: HIDDEN[i] -> 32

:func:`run` is the ruler every test measures with: one forward and backward of the batch inside a
``MemoryTracker`` (``minifsdp.memory.tracker``), whose count the census audits when it ends.  Its ``"peak"``
is the most live tensor bytes at any moment of the forward and backward, less those alive just before it
(the model's weights, the batch): activations, the gradients, and every temporary.

    peak(no block checkpointed)      what the budget is compared with
    run(model, batch)["grads"]       {parameter name: gradient}, names as in the plain model
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from minifsdp.memory.tracker import MemoryTracker

__all__ = ["HIDDEN", "Tower", "make_batch", "run", "WRAPPER_PREFIX"]

HIDDEN = (256, 64, 512, 128, 384)  # the hidden width of each block
WIDTH, BATCH, DROPOUT = 32, 64, 0.1
WRAPPER_PREFIX = "_checkpoint_wrapped_module."  # torch's checkpoint_wrapper adds it to parameter names


class Block(nn.Module):
    def __init__(self, width: int, hidden: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, hidden)
        self.fc2 = nn.Linear(hidden, width)
        self.drop = nn.Dropout(DROPOUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.fc2(F.gelu(self.fc1(self.norm(x)))))


class Tower(nn.Module):
    """``blocks.0`` ... ``blocks.4`` and a head; the same numbers for the same seed."""

    def __init__(self, seed: int = 0):
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.blocks = nn.ModuleList(Block(WIDTH, h) for h in HIDDEN)
            self.head = nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def make_batch(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(BATCH, WIDTH, generator=g), torch.randn(BATCH, 1, generator=g)


def run(model: nn.Module, batch, seed: int = 2) -> dict:
    """One forward and backward of ``batch`` (dropout drawn from ``seed``), measured; the gradients start as None.

    Returns ``{"peak": bytes, "grads": {name: gradient}, "audit": bytes the census found that the tracker
    missed (0 when its count is right)}``."""
    model.zero_grad(set_to_none=True)
    x, y = batch
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        with MemoryTracker(model) as tracker:
            loss = F.mse_loss(model(x), y)
            loss.backward()
            del loss
    grads = {n.replace(WRAPPER_PREFIX, ""): p.grad for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return {"peak": tracker.peak_bytes - tracker.timeline[0][1], "grads": grads, "audit": tracker.found_at_exit}
