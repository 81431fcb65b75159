"""Mixed precision under FSDP (chapter 4.1): low-precision compute, fp32 master shards.

    MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, buffer_dtype=torch.bfloat16)

One unit, rank r, FULL_SHARD, in torch FSDP1's order (``_flat_param.py``,
``_runtime_utils.py``):

    flat_param (fp32)  --cast-->  local shard (param_dtype)  --all-gather-->  full (param_dtype)
                                                                                |  forward, backward
    flat_param.grad (fp32) <--cast-- /(N/f) <-- reduce-scatter <-- /f <-- full grad --cast--> (reduce_dtype)

* the optimizer only ever sees fp32: the sharded master parameters and their
  fp32 gradient shards (``keep_low_precision_grads=False``, torch's default; with True
  the gradient shards stay in ``param_dtype``, as torch's);
* the cast happens on the *shard* before the all-gather, so the all-gather
  moves half the bytes, and each rank casts only its 1/N;
* gradients are divided by ``f`` before and ``N / f`` after the reduction (see
  ``sharding.py``), in ``reduce_dtype``: that is why torch pre-divides at all;
* floating-point buffers are cast to ``buffer_dtype`` once, at the root's first
  forward; the root casts floating-point forward inputs to ``param_dtype``
  (``cast_root_forward_inputs``), every unit too if ``cast_forward_inputs``.

Note (not autocast): ``torch.autocast`` picks a dtype per *op* (matmuls in
low precision, softmax and norms in fp32) and keeps fp32 weights, casting them
at every use.  FSDP's ``MixedPrecision`` casts the *parameters* once per
all-gather, so every op of the unit runs in ``param_dtype``, layer norms
included.  The two compose (autocast inside an FSDP model) but differ.

:class:`ShardedGradScaler` (``grad_scaler.py``, re-exported here) is fp16's loss scaling for
sharded gradients: each rank sees only its shard, so "did any gradient overflow?" needs one
all-reduce of a flag, and then every rank skips (or takes) the step together.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch.nn.modules.batchnorm import _BatchNorm

from minifsdp.fsdp.flat_param import padded_size
from minifsdp.fsdp.grad_scaler import ShardedGradScaler  # its own module; re-exported here as before
from minifsdp.fsdp.sharding import finish_reduced_shard, predivide_factor, prepare_for_reduce_scatter

__all__ = ["MixedPrecision", "ShardedGradScaler", "cast_floating", "reduce_gradient_shard"]


@dataclass(frozen=True)
class MixedPrecision:
    """torch FSDP1's ``MixedPrecision``; ``None`` means "keep the original dtype" for that part.

    As torch: if ``param_dtype`` is given and ``reduce_dtype`` is not, gradients
    are reduced in ``param_dtype``.
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    buffer_dtype: torch.dtype | None = None
    keep_low_precision_grads: bool = False
    cast_forward_inputs: bool = False
    cast_root_forward_inputs: bool = True
    _module_classes_to_ignore: Sequence[type] = (_BatchNorm,)  # torch's: own units in fp32 (torch_options.py)

    def __post_init__(self):
        for name in ("param_dtype", "reduce_dtype", "buffer_dtype"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, torch.dtype) or not value.is_floating_point):
                raise ValueError(f"MixedPrecision.{name} must be a floating dtype such as torch.bfloat16, "
                                 f"got {value!r}")

    def dtypes_for(self, orig_dtype: torch.dtype) -> tuple[torch.dtype, torch.dtype]:
        """(compute dtype of the unsharded parameters, dtype of the gradient reduction), as torch resolves them."""
        if self.param_dtype is not None and self.reduce_dtype is None:
            return self.param_dtype, self.param_dtype
        return self.param_dtype or orig_dtype, self.reduce_dtype or orig_dtype


def cast_floating(obj, dtype: torch.dtype | None):
    """Cast every floating-point tensor in a nest of tuples/lists/dicts to ``dtype`` (others untouched)."""
    if dtype is None:
        return obj
    if isinstance(obj, torch.Tensor):
        return obj.to(dtype) if obj.is_floating_point() and obj.dtype != dtype else obj
    if isinstance(obj, (list, tuple)):
        return type(obj)(cast_floating(o, dtype) for o in obj)
    if isinstance(obj, dict):
        return {k: cast_floating(v, dtype) for k, v in obj.items()}
    return obj


def reduce_gradient_shard(rank_grads: list[torch.Tensor], rank: int, reduce_dtype: torch.dtype,
                          param_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """One unit's gradient reduction under mixed precision, all ranks simulated in one process.

    ``rank_grads[r]``: rank r's full 1-D gradient (compute dtype).  Returns rank
    ``rank``'s gradient shard in ``param_dtype``, with the same two steps as
    ``FlatParamHandle.start_reduce`` / ``finish_reduce`` (``sharding.py``), the
    reduce-scatter replaced by a sum in rank order (exercise 4.1b's reference):

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
