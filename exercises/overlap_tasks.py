"""Tasks 2.5 and 4.1a-b: prefetch order from a recorded execution order; the mixed-precision casts of one unit.

* 2.5 :func:`prefetch_target`: which unit's all-gather to start early, read from the
  order the units ran in (torch FSDP1's rule).
* 4.1a :func:`mixed_precision_dtypes`: which dtype the unit computes in and which it
  reduces gradients in, from a ``MixedPrecision`` that may leave some fields ``None``.
* 4.1b :func:`reduce_gradient_shard`: one unit's gradient reduction under mixed precision,
  every rank simulated in one process, with torch FSDP1's casts and divisions in its order.

The task text and hints are in ``exercises/README_overlap.md``.  Grade with::

    pytest tests/exercises/test_overlap_exercises.py --impl=student      # or -k 4_1b for one task

Then run 2.5 inside a real FSDP training run, compared bitwise with ours::

    python -m minifsdp train --impl student --student 2.5 --steps 8

Reference solution: ``minifsdp.fsdp.core.prefetch.prefetch_target``,
``minifsdp.fsdp.core.mixed_precision.resolve_dtypes`` and
``reduce_gradient_shard`` in ``exercises/solutions/overlap_tasks.py`` (read them after you are done).
"""

from __future__ import annotations

import torch


def prefetch_target(pre_forward: list, post_forward: list, unit, mode: str):
    """Task 2.5.  The unit whose all-gather to start early, from ``unit``, or None.

    Args:
        pre_forward: the units in the order their forward *started* (first iteration).
        post_forward: the units in the order their forward *finished* (this iteration).
        unit: the unit running now.
        mode: ``"forward"`` (forward_prefetch) or ``"backward"`` (BACKWARD_PRE / BACKWARD_POST).

    forward: the unit after ``unit`` in ``pre_forward``.  backward: the backward visits
    the units in reverse order of their forward's *end*, so the unit before ``unit`` in
    ``post_forward``.  None past either end, or if ``unit`` is not in the list.  Any other
    mode: raise ValueError.
    """
    raise NotImplementedError("Task 2.5: prefetch_target -- see exercises/README_overlap.md")


def mixed_precision_dtypes(param_dtype, reduce_dtype, orig_dtype: torch.dtype) -> tuple[torch.dtype, torch.dtype]:
    """Task 4.1a.  (compute dtype, gradient-reduction dtype) of a unit whose parameters are ``orig_dtype``.

    ``param_dtype`` / ``reduce_dtype`` are a MixedPrecision's fields, each a dtype or None
    ("keep the original").  torch's rule has one twist: see the README.
    """
    raise NotImplementedError("Task 4.1a: mixed_precision_dtypes -- see exercises/README_overlap.md")


def reduce_gradient_shard(rank_grads: list[torch.Tensor], rank: int, reduce_dtype: torch.dtype,
                          param_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Task 4.1b.  Rank ``rank``'s gradient shard after the reduce-scatter, as torch FSDP1 computes it.

    Args:
        rank_grads: N tensors, rank r's full 1-D gradient of the unit (in the compute dtype,
            e.g. bfloat16), all of the same length ``numel``.  Do not modify them.
        rank: whose shard to return.
        reduce_dtype: the dtype the reduction runs in.
        param_dtype: the dtype of the sharded parameter (the optimizer's): the result's dtype.

    Returns a 1-D tensor of ``ceil(numel / N)`` numbers: the *average* over ranks of chunk
    ``rank`` of the (zero-padded) gradients.  Every intermediate must be rounded where torch
    rounds it (the grader compares bitwise): see the README for the order of the steps.
    """
    raise NotImplementedError("Task 4.1b: reduce_gradient_shard -- see exercises/README_overlap.md")
