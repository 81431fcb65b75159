"""Chapter 5: ``MixedPrecisionPolicy``, FSDP2's mixed precision, and the casts it implies.

Mirrors torch's ``torch.distributed.fsdp.MixedPrecisionPolicy`` field by field:

* ``param_dtype``  -- the dtype of the *unsharded* parameters (the all-gather moves this dtype;
  forward and backward compute in it).  The sharded parameters and the optimizer stay in the
  original dtype (fp32), so the update is exact; only the gathered copy is low precision.
* ``reduce_dtype`` -- the dtype of the gradient reduce-scatter (bf16 grads are cast up to fp32
  before the sum when ``reduce_dtype=torch.float32``); ``None`` means the gradients' own dtype.
* ``output_dtype`` -- if set, floating-point outputs of the module's forward are cast to it.
* ``cast_forward_inputs`` -- cast floating-point forward inputs to ``param_dtype`` (default True).

Compared with FSDP1's ``MixedPrecision(param_dtype, reduce_dtype, buffer_dtype)``: there is no
``buffer_dtype`` (FSDP2 leaves buffers alone), and the policy is per ``fully_shard`` call, so each
block may have its own.

Note (the divide): with N ranks the reduce-scatter averages.  For fp32 and bf16 torch asks the
collective for ``AVG`` (one division inside the collective); for fp16 it divides by about sqrt(N)
before and by the rest after a ``SUM``, to keep small gradients from underflowing and large sums from
overflowing.  :func:`reduce_scatter_op` says which, and ours follows it so results match bitwise.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minifsdp.fsdp.core.strategy import predivide_factor

__all__ = ["MixedPrecisionPolicy", "reduce_scatter_op"]


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """What dtypes one ``fully_shard`` call computes, reduces and returns in (torch's fields and defaults)."""

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True


def reduce_scatter_op(world_size: int, reduce_dtype: torch.dtype) -> tuple[str, float | None, float | None]:
    """``(op, divide_before, divide_after)`` for averaging gradients over ``world_size`` ranks, as torch's.

    fp32/bf16: ``("avg", None, None)`` (``("sum", None, None)`` at one rank).
    fp16: a ``"sum"`` with the factor N split into a power of two before and the rest after.
    """
    if reduce_dtype in (torch.float32, torch.bfloat16):
        return ("sum" if world_size == 1 else "avg"), None, None
    pre = predivide_factor(world_size)  # torch FSDP1's factor, which torch FSDP2 reuses
    return "sum", pre, world_size / pre
