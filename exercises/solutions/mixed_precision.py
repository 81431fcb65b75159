"""One unit's gradient reduction under mixed precision, every rank simulated in one process (exercise 4.1b).

The same steps as ``minifsdp/fsdp/core/gradient.py`` (``start_reduce`` then ``finish_reduce``),
with the reduce-scatter replaced by a sum in rank order.
"""

from __future__ import annotations

import torch

from minifsdp.fsdp.core.flat_param import padded_size
from minifsdp.fsdp.core.strategy import finish_reduced_shard, predivide_factor, prepare_for_reduce_scatter

__all__ = ["reduce_gradient_shard"]


def reduce_gradient_shard(rank_grads: list[torch.Tensor], rank: int, reduce_dtype: torch.dtype,
                          param_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """One unit's gradient reduction under mixed precision, all ranks simulated in one process.

    ``rank_grads[r]``: rank r's full 1-D gradient (compute dtype).  Returns rank
    ``rank``'s gradient shard in ``param_dtype``, with the same two steps as
    ``UnitGradient.start_reduce`` / ``finish_reduce`` (``core/gradient.py``), the
    reduce-scatter replaced by a sum in rank order (exercise 4.1b's answer):

        cast to reduce_dtype -> pad to a multiple of N -> / f -> sum over ranks
        -> keep chunk ``rank`` -> / (N / f) -> cast to param_dtype
    """
    n = len(rank_grads)
    f = predivide_factor(n)
    padded = padded_size(rank_grads[0].numel(), n)
    total = None
    for g in rank_grads:
        g = prepare_for_reduce_scatter(g.clone(), padded, reduce_dtype, f)  # a copy: the caller's stays as is
        total = g if total is None else total + g
    shard = total[rank * (padded // n): (rank + 1) * (padded // n)].clone()
    return finish_reduced_shard(shard, n / f, param_dtype)
