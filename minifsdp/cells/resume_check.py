"""Is a resumed run the run that never stopped?  The pieces of notebook 04's §4.3 cells.

The oracle of every resume experiment in chapter 4.3 is the *uninterrupted run*: the tiny GPT under our
FSDP (one unit per ``Block``), AdamW, :data:`STEPS` steps.  A resumed run trains the same model the same way
for :data:`STOP` steps, saves, loads into a *fresh* model and optimizer (another seed, another RNG state:
a new process would have both), and trains the remaining steps.  It resumed correctly only if its losses
and its final full parameters are bitwise the uninterrupted run's.

Why the global RNG matters here: :func:`step` masks a random tenth of the input tokens with the global
RNG (as dropout or data augmentation would), so a resume that forgot to restore the RNG state draws
other masks and drifts, even with the right weights and optimizer state.

Each ``%%ranks`` cell is a fresh set of processes, so each cell recomputes what it needs; every function
here is deterministic, so the state after :data:`STOP` steps is the same in every cell:

    new_model(seed), new_opt(model)   the model and optimizer every run uses (only the init seed varies)
    step(model, opt, i)               training step i on this rank's slice of batch i; returns the loss
    run_steps(n)                      seed the global RNG, build, train n steps: a run up to step n
    uninterrupted_run()               the oracle: the losses and final full state dict of the run that never stops
    save_checkpoint(...)              the source's function, unchanged
    same(a, b)                        two state dicts bitwise equal, key by key
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from minifsdp.checkpoint import full_state_dict
from minifsdp.fsdp import FSDP
from minifsdp.fsdp.core.wrap import transformer_auto_wrap_policy
from minifsdp.models import Block, CharCorpus, TinyGPT

__all__ = ["STEPS", "STOP", "new_model", "new_opt", "step", "run_steps", "uninterrupted_run",
           "save_checkpoint", "same"]

STEPS = 6  # the uninterrupted run's length
STOP = 3  # where a resumed run stops, saves and is loaded again


@functools.cache
def _corpus() -> CharCorpus:
    return CharCorpus()


def new_model(seed: int = 0) -> FSDP:
    """The tiny GPT (weights from ``seed``) under our FSDP, one unit per ``Block``."""
    return FSDP(TinyGPT(seed=seed),
                auto_wrap_policy=functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block}))


def new_opt(model) -> torch.optim.AdamW:
    """AdamW with weight decay: its moments are the optimizer state a checkpoint must carry."""
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def step(model, opt, i: int) -> float:
    """Training step ``i``: this rank's slice of batch ``i``, a random tenth of its tokens masked (the global RNG)."""
    x, y = _corpus().batch(i, 4, 32, dist.get_rank(), dist.get_world_size())
    x = torch.where(torch.rand(x.shape) < 0.1, torch.zeros_like(x), x)  # uses the global RNG
    loss = model(x, y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def run_steps(n: int):
    """(model, optimizer, losses) of a run trained for steps 0..n-1 from the start (global seed 100 + rank)."""
    torch.manual_seed(100 + dist.get_rank())
    model = new_model()
    opt = new_opt(model)
    losses = [step(model, opt, i) for i in range(n)]
    return model, opt, losses


def uninterrupted_run():
    """The oracle: (losses, final full state dict) of the run that trains all :data:`STEPS` steps without stopping."""
    model, _, losses = run_steps(STEPS)
    return losses, full_state_dict(model)


def save_checkpoint(model, optimizer, epoch, path):
    """The source's code, unchanged: ``model.state_dict()`` and ``optimizer.state_dict()`` into one ``torch.save``.

    Under FSDP ``model.state_dict()`` is a collective (every rank must call it) and ``optimizer.state_dict()``
    holds this rank's flat shards only: notebook §4.3 shows what that means for a resume.
    """
    torch.save({'epoch': epoch, 'model_state_dict': model.state_dict(),
                'optimizer_state_dict': optimizer.state_dict()}, path)


def same(a: dict, b: dict) -> bool:
    """The same keys, and every tensor bitwise equal."""
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
