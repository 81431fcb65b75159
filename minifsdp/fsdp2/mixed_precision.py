"""Chapter 5: ``MixedPrecisionPolicy`` and ``CPUOffloadPolicy``, FSDP2's per-call policies, and the gradient divide.

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

``OffloadPolicy()`` (the default: nothing offloaded) and ``CPUOffloadPolicy(pin_memory=True)`` mirror torch's:
with the latter the sharded parameters, their gradients and so the optimizer state stay in CPU memory, and each
all-gather input is copied to the compute device (see :mod:`minifsdp.fsdp2.param`).

Note (the divide): with N ranks the reduce-scatter averages.  For fp32 and bf16 torch asks the
collective for ``AVG`` (one division inside the collective); for fp16 it divides by about sqrt(N)
before and by the rest after a ``SUM``, to keep small gradients from underflowing and large sums from
overflowing.  :func:`gradient_divide_factors` says which, also for a factor the user sets
(``set_gradient_divide_factor``) and for sums only (``set_force_sum_reduction_for_comms``), and ours follows
torch's rule so results match bitwise.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minifsdp.fsdp.core.strategy import predivide_factor

__all__ = ["MixedPrecisionPolicy", "OffloadPolicy", "CPUOffloadPolicy", "gradient_divide_factors"]


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """What dtypes one ``fully_shard`` call computes, reduces and returns in (torch's fields and defaults)."""

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True


@dataclass
class OffloadPolicy:
    """No offloading (torch's default policy object)."""


@dataclass
class CPUOffloadPolicy(OffloadPolicy):
    """Sharded parameters, gradients and optimizer state in CPU memory; ``pin_memory`` as torch's (it needs an
    accelerator: on a CPU-only machine torch refuses ``pin_memory=True``, and so does ours)."""

    pin_memory: bool = True


def gradient_divide_factors(shard_size: int, replicate_size: int, reduce_dtype: torch.dtype,
                            factor: float | None = None, force_sum: bool = False):
    """``(divide before, divide after, reduce-scatter op, all-reduce op)``, torch FSDP2's rule.

    fp32/bf16 without a factor: ``avg`` in both collectives (``sum`` at one rank in all); with a factor f: the
    reduce-scatter ``avg`` if f is the shard size, else ``("premul_sum", 1/f)``, the all-reduce ``sum``.  fp16 (or
    sums forced): ``sum`` in both, f (default: every data-parallel rank) split into a power of two before and
    the rest after, for fp16; all of it after, when only the sums were forced.
    """
    overflow_risk = reduce_dtype not in (torch.float32, torch.bfloat16)
    dp_size = shard_size * replicate_size
    if not overflow_risk and not force_sum:
        if factor is None:
            return (None, None, "sum", "sum") if dp_size == 1 else (None, None, "avg", "avg")
        rs_op = "avg" if factor == shard_size else ("premul_sum", 1.0 / factor)
        return None, None, rs_op, "sum"
    factor = float(dp_size) if factor is None else factor
    if overflow_risk:
        pre = predivide_factor(factor)  # torch FSDP1's power of two, which torch FSDP2 reuses
        return pre, factor / pre, "sum", "sum"
    return None, factor, "sum", "sum"
