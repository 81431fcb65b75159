"""Mixed precision (chapter 4.1): fp32 master shards, low-precision compute and communication.

    flat_param (fp32 shard) --cast--> param_dtype shard --all-gather--> full (param_dtype) --> forward, backward
    flat_param.grad (fp32) <--cast-- /(N/f) <-- reduce-scatter <-- /f <-- full grad --cast--> reduce_dtype

The optimizer sees fp32 only (``keep_low_precision_grads=True`` keeps the gradient shards in
``param_dtype``); the *shard* is cast before the all-gather, so half the bytes move; the
divides by ``f`` and ``N / f`` happen in ``reduce_dtype`` (``strategy.py``); floating-point
buffers are cast to ``buffer_dtype`` once, at the root's first forward; the root casts
floating-point inputs to ``param_dtype`` (every unit with ``cast_forward_inputs``).

Note (not autocast): ``torch.autocast`` picks a dtype per *op* and casts fp32 weights at every
use; ``MixedPrecision`` casts the parameters once per all-gather, so every op of the unit runs
in ``param_dtype``, layer norms included.
"""

from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch.distributed.utils import _apply_to_tensors
from torch.nn.modules.batchnorm import _BatchNorm


@dataclass(frozen=True)
class MixedPrecision:
    """torch FSDP1's ``MixedPrecision``; ``None`` keeps the original dtype for that part (``param_dtype`` alone
    also reduces in it).  ``_module_classes_to_ignore``: their own fp32 units, in the public class."""

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    buffer_dtype: torch.dtype | None = None
    keep_low_precision_grads: bool = False
    cast_forward_inputs: bool = False
    cast_root_forward_inputs: bool = True
    _module_classes_to_ignore: Sequence[type] = (_BatchNorm,)

    def __post_init__(self):
        for name in ("param_dtype", "reduce_dtype", "buffer_dtype"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, torch.dtype) or not value.is_floating_point):
                raise ValueError(f"MixedPrecision.{name} must be a floating dtype such as torch.bfloat16, "
                                 f"got {value!r}")


@dataclass(frozen=True)
class UnitDtypes:
    """The four dtypes of one unit."""

    orig: torch.dtype  # the sharded parameters: what the optimizer steps
    param: torch.dtype  # the gathered copy the forward and backward compute in
    reduce: torch.dtype  # the gradient reduction
    grad: torch.dtype  # the gradient shard the optimizer receives

    @property
    def casts_params(self) -> bool:
        return self.param != self.orig


def resolve_dtypes(mp: MixedPrecision | None, orig: torch.dtype) -> UnitDtypes:
    """A unit's dtypes under ``mp`` (None: everything in ``orig``), as torch resolves them."""
    if mp is None:
        return UnitDtypes(orig, orig, orig, orig)
    param = mp.param_dtype or orig
    reduce = mp.param_dtype if mp.reduce_dtype is None and mp.param_dtype is not None else mp.reduce_dtype or orig
    return UnitDtypes(orig, param, reduce, param if mp.keep_low_precision_grads else orig)


def cast_floating(tree: Any, dtype: torch.dtype | None) -> Any:
    """Every floating-point tensor in a nest (tuples, lists, dicts, namedtuples, dataclasses) cast to ``dtype``,
    others untouched; torch's own walk of the nest, the one both FSDP generations cast with."""
    if dtype is None:
        return tree
    return _apply_to_tensors(lambda x: x.to(dtype) if x.is_floating_point() and x.dtype != dtype else x, tree)
