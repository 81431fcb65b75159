"""Mixed precision (chapter 4.1): fp32 master shards, low-precision compute and communication.

    flat_param (fp32 shard) --cast--> param_dtype shard --all-gather--> full (param_dtype) --> forward, backward
    flat_param.grad (fp32) <--cast-- /(N/f) <-- reduce-scatter <-- /f <-- full grad --cast--> reduce_dtype

The optimizer sees fp32 only (``keep_low_precision_grads`` keeps gradient shards in ``param_dtype``, cast
once from the fp32 sum of the backwards they accumulate, and NO_SHARD's in ``reduce_dtype``, as torch's);
the *shard* is cast before the all-gather, so half the bytes move; the divides by ``f`` and ``N / f``
happen in ``reduce_dtype``; buffers are cast to ``buffer_dtype`` once, at the root's first forward;
the root casts floating-point inputs to ``param_dtype`` (every unit with ``cast_forward_inputs``).

Note (not autocast): ``torch.autocast`` picks a dtype per *op* and casts fp32 weights at every
use; ``MixedPrecision`` casts the parameters once per all-gather, so every op of the unit runs
in ``param_dtype``, layer norms included.
"""

from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.utils import _apply_to_tensors


@dataclass(frozen=True)
class MixedPrecision:
    """torch FSDP1's ``MixedPrecision`` (``torch/distributed/fsdp/api.py``); ``None`` keeps the original dtype
    for that part (``param_dtype`` alone also reduces in it).  torch's private fields live in ``minifsdp.FSDP``'s."""
    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    buffer_dtype: torch.dtype | None = None
    keep_low_precision_grads: bool = False
    cast_forward_inputs: bool = False
    cast_root_forward_inputs: bool = True

    def __post_init__(self):
        for name, v in [(n, getattr(self, n)) for n in ("param_dtype", "reduce_dtype", "buffer_dtype")]:
            if v is not None and (not isinstance(v, torch.dtype) or not v.is_floating_point):
                raise ValueError(f"MixedPrecision.{name} must be a floating dtype such as torch.bfloat16, got {v!r}")

@dataclass(frozen=True)
class UnitDtypes:
    """The four dtypes of one unit.  ``MixedPrecision(param_dtype=torch.bfloat16)`` on fp32 parameters:
    ``orig`` fp32, ``param`` bf16, ``reduce`` bf16 (from ``param_dtype``), ``grad`` fp32."""
    orig: torch.dtype  # the sharded parameters: what the optimizer steps
    param: torch.dtype  # the gathered copy the forward and backward compute in
    reduce: torch.dtype  # the gradient reduction
    grad: torch.dtype  # the gradient shard the optimizer receives

    casts_params = property(lambda self: self.param != self.orig)  # a low-precision copy to gather and compute in

def resolve_dtypes(mp: MixedPrecision | None, orig: torch.dtype) -> UnitDtypes:
    """A unit's dtypes under ``mp`` (None: everything in ``orig``), as torch resolves them.

    torch: ``FlatParamHandle._init_param_reduce_dtypes`` (``_flat_param.py``) sets ``_fwd_bwd_param_dtype`` and
    ``_reduce_dtype`` by the same rule; a ``param_dtype`` with no ``reduce_dtype`` reduces in ``param_dtype``."""
    if mp is None:
        return UnitDtypes(orig, orig, orig, orig)
    param = mp.param_dtype or orig  # None keeps the original dtype for that part
    reduce = mp.param_dtype if mp.reduce_dtype is None and mp.param_dtype is not None else mp.reduce_dtype or orig
    return UnitDtypes(orig, param, reduce, param if mp.keep_low_precision_grads else orig)

def cast_floating(tree: Any, dtype: torch.dtype | None) -> Any:
    """Every floating-point tensor in a nest (tuples, lists, dicts, namedtuples, dataclasses) cast to ``dtype``,
    others untouched; torch's own walk of the nest, the one both FSDP generations cast with.

    Why cast the inputs?  A bf16 weight and an fp32 activation would fail (a Linear) or promote (an add);
    the root's inputs are cast once, and what the units compute from them comes out in ``param_dtype``."""
    if dtype is None:
        return tree
    return _apply_to_tensors(lambda x: x.to(dtype) if x.is_floating_point() and x.dtype != dtype else x, tree)

KEEP_DTYPE = "_fsdp_keep_dtype"  # a buffer an extension marks with this attribute keeps its dtype

def cast_buffers(units: list) -> dict:
    """The root's first forward: each floating-point buffer cast in place to its own unit's ``buffer_dtype``, once
    (torch's ``_cast_buffers_to_dtype_and_device``); returns ``{(id(module), name): its dtype before}``."""
    before, claimed = {}, set()  # (id(module), buffer name) pairs
    for unit in reversed(units):  # innermost first: a buffer belongs to the innermost unit that holds it
        mp = unit.mixed_precision
        for m in unit.module.modules():
            for name, b in m._buffers.items():
                if b is None or (id(m), name) in claimed or getattr(b, KEEP_DTYPE, False):
                    continue
                claimed.add((id(m), name))
                if mp is not None and mp.buffer_dtype not in (None, b.dtype) and b.is_floating_point():
                    before[(id(m), name)] = b.dtype
                    b.data = b.to(mp.buffer_dtype)
    return before
