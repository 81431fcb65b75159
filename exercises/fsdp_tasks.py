"""Tasks 2.1a-c: the three operations at the heart of FSDP, as plain functions.

* 2.1a :func:`flatten_and_shard` and :func:`unflatten`: many parameters -> one flat
  buffer -> this rank's 1/N shard; and back, as views of the full buffer.
* 2.1b :func:`reduce_scatter_gradient`: after the backward, every rank holds a whole
  gradient; keep only your shard of the average, exactly as torch FSDP1 does.
* 2.1c :func:`clip_grad_norm_sharded_`: gradient clipping when no rank holds the whole gradient.

The task text and hints are in ``exercises/README_fsdp.md``.  Grade with::

    pytest tests/exercises/test_fsdp_exercises.py --impl=student        # or -k 2.1b for one task

Then run 2.1a inside a real FSDP training run, compared bitwise with ours::

    python -m minifsdp train --impl student --student 2.1a --steps 8

Reference solution: ``exercises/solutions/fsdp_tasks.py`` (read it after you are done).
"""

from __future__ import annotations

import torch
import torch.distributed as dist  # noqa: F401  (you will need it for 2.1b and 2.1c)


def flatten_and_shard(tensors: list[torch.Tensor], rank: int, world_size: int) -> torch.Tensor:
    """Task 2.1a (i).  This rank's shard of the flat parameter.

    Args:
        tensors: the unit's parameters, any shapes, in order.  Do not modify them.
        rank, world_size: which of the N shards to return.

    Flatten every tensor and concatenate them in order, pad the end with zeros to a
    multiple of N, cut into N equal shards and return shard ``rank`` as a new 1-D tensor
    of ``ceil(total numel / N)`` numbers (one that owns its memory: not a view of anything).
    """
    raise NotImplementedError("Task 2.1a: flatten_and_shard -- see exercises/README_fsdp.md")


def unflatten(flat: torch.Tensor, shapes: list[torch.Size]) -> list[torch.Tensor]:
    """Task 2.1a (ii).  The original tensors as *views* of the full flat buffer.

    Args:
        flat: the full (all-gathered) 1-D buffer; may be longer than the shapes need (padding).
        shapes: the original shapes, in flattening order.

    Returns one tensor per shape, each a view into ``flat`` (no copy: writing into a view
    changes ``flat``, and gradients flowing into the views land in ``flat``'s gradient).
    """
    raise NotImplementedError("Task 2.1a: unflatten -- see exercises/README_fsdp.md")


def reduce_scatter_gradient(full_grad: torch.Tensor, group=None) -> torch.Tensor:
    """Task 2.1b.  This rank's shard of the gradient averaged over the ranks of ``group``.

    Args:
        full_grad: this rank's whole 1-D flat gradient (unpadded).  Do not modify it.
        group: the process group (None: all ranks); N = its size.

    Pad to a multiple of N, divide by torch FSDP1's pre-divide factor f, reduce-scatter
    with ``dist.reduce_scatter_tensor`` (sum), divide by N / f.  The result must be
    bitwise equal to what torch FSDP1 leaves in its sharded ``.grad``.
    """
    raise NotImplementedError("Task 2.1b: reduce_scatter_gradient -- see exercises/README_fsdp.md")


def clip_grad_norm_sharded_(grad_shards: list[torch.Tensor], max_norm: float, group=None) -> torch.Tensor:
    """Task 2.1c.  Clip by the global L2 norm, each rank holding only shards of the gradient.

    Args:
        grad_shards: this rank's gradient shards (1-D; some may be empty).  Scaled in place.
        max_norm: the largest total norm allowed.
        group: the process group (None: all ranks).

    Returns the total norm (a 0-d tensor, the same on every rank): the L2 norm of the whole
    gradient, as if every rank's shards were concatenated.  Scale every shard in place by
    ``min(1, max_norm / (total + 1e-6))``, as torch does.
    """
    raise NotImplementedError("Task 2.1c: clip_grad_norm_sharded_ -- see exercises/README_fsdp.md")
