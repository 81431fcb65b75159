"""Project gradient accumulation under ``no_sync`` (``project-noshard-accum``): FULL_SHARD against SHARD_GRAD_OP.

The goal, the oracle and the hints: ``exercises/projects/noshard_accum/README.md``.  Grade with::

    pytest tests/exercises/projects/test_noshard_accum.py --impl=student

Write the three functions; add whatever helpers you like in this file.
"""

from __future__ import annotations

from minifsdp.comm.counting import count_bytes  # noqa: F401 - what "bytes sent" means
from minifsdp.memory.census import live_tensor_bytes  # noqa: F401 - what "bytes held" means
from minifsdp.memory.tracker import MemoryTracker  # noqa: F401 - what "peak" means

__all__ = ["accumulate", "measure", "predict"]


def accumulate(model, micro_batches, loss_fn, after_micro_batch=None) -> list[float]:
    """The forward and backward of every micro-batch, with gradients reduced once, at the last one.

    Args:
        model: a model wrapped by FSDP (torch FSDP1 or ours: the same API), FULL_SHARD or SHARD_GRAD_OP; its
            gradients start as None.
        micro_batches: K batches of this rank; ``loss_fn(model, batch)`` is a micro-batch's scalar loss.
        after_micro_batch: if given, call ``after_micro_batch(k)`` right after micro-batch k's backward.

    Afterwards each parameter's ``.grad`` is the sharded gradient one step on all K micro-batches of every rank
    needs, as torch's users accumulate it (see the README).  Do not step an optimizer.  Returns the K losses
    that went into the backwards, as floats.
    """
    raise NotImplementedError("project-noshard-accum: accumulate -- see exercises/projects/noshard_accum/README.md")


def measure(model, micro_batches, loss_fn) -> list[dict]:
    """Run :func:`accumulate` on ``model`` and return one dict per micro-batch k with int values:

    ``"sent"``: bytes this rank sent through the book's collectives during micro-batch k;
    ``"held"``: live tensor bytes right after micro-batch k, less those just before the first micro-batch;
    ``"peak"``: the most live tensor bytes at any moment of micro-batch k, less those just before the first.
    """
    raise NotImplementedError("project-noshard-accum: measure -- see exercises/projects/noshard_accum/README.md")


def predict(unit_numels: list[int], world_size: int, strategy: str, num_micro_batches: int,
            itemsize: int = 4) -> list[dict]:
    """What :func:`measure` will find, without running anything: one dict per micro-batch, ``"sent"`` and
    ``"held"`` as there, in bytes.

    ``unit_numels``: each FSDP unit's number of parameters (unpadded), the root unit first; ``strategy``:
    ``"FULL_SHARD"`` or ``"SHARD_GRAD_OP"`` (anything else: ValueError); ``itemsize``: bytes per number.
    """
    raise NotImplementedError("project-noshard-accum: predict -- see exercises/projects/noshard_accum/README.md")
