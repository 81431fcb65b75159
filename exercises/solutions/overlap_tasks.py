"""The answers to tasks 2.5 and 4.1a-b (``exercises/overlap_tasks.py``).

2.5 and 4.1a are the core's own functions (``minifsdp/fsdp/core/prefetch.py``, ``mixed_precision.py``);
4.1b is one unit's gradient reduction (``UnitGradient.start_reduce`` then ``finish_reduce`` in
``minifsdp/fsdp/core/gradient.py``) with every rank simulated in one process, the reduce-scatter
replaced by a sum in rank order:

    cast to reduce_dtype -> pad to a multiple of N -> / f -> sum over ranks
    -> keep chunk ``rank`` -> / (N / f) -> cast to param_dtype
"""

from __future__ import annotations

import torch

from minifsdp.fsdp.core.flat_param import padded_size
from minifsdp.fsdp.core.gradient import finish_reduced_shard, reduction_input
from minifsdp.fsdp.core.mixed_precision import MixedPrecision, resolve_dtypes
from minifsdp.fsdp.core.prefetch import prefetch_target
from minifsdp.fsdp.core.strategy import predivide_factor

__all__ = ["prefetch_target", "mixed_precision_dtypes", "reduce_gradient_shard"]


def mixed_precision_dtypes(param_dtype, reduce_dtype, orig_dtype: torch.dtype) -> tuple[torch.dtype, torch.dtype]:
    """Task 4.1a: (compute dtype, gradient-reduction dtype), as the core resolves a ``MixedPrecision``."""
    d = resolve_dtypes(MixedPrecision(param_dtype=param_dtype, reduce_dtype=reduce_dtype), orig_dtype)
    return d.param, d.reduce


def reduce_gradient_shard(rank_grads: list[torch.Tensor], rank: int, reduce_dtype: torch.dtype,
                          param_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Task 4.1b: rank ``rank``'s gradient shard in ``param_dtype``, all ranks simulated (see the module docstring)."""
    n = len(rank_grads)
    f = predivide_factor(n)
    padded = padded_size(rank_grads[0].numel(), n)
    total = None
    for g in rank_grads:
        g = reduction_input(g.clone(), padded, reduce_dtype, f)  # a copy: the caller's stays as is
        total = g if total is None else total + g
    shard = total[rank * (padded // n): (rank + 1) * (padded // n)].clone()
    return finish_reduced_shard(shard, n / f, param_dtype)
