"""What an FSDP unit is, how to find the units in a model, and the plain model's names for them.

A *unit* is one wrapped module: ``FullyShardedDataParallel(module)`` (``fully_sharded.py``)
is a subclass of :class:`Unit`.  Everything else that only needs to ask "is this a
unit?" or "which units are in this model?" (prefetching, wrapping, checkpoints,
the tracer, the plots) imports this small module instead of the big class, so the
imports run one way: ``units.py`` <- everything else <- ``fully_sharded.py``.

Wrapping inserts one attribute level per unit, so the names torch users know gain
a ``_fsdp_wrapped_module`` part that :func:`clean_name` removes:

    wrapped model                                        plain model
    _fsdp_wrapped_module.blocks.0._fsdp_wrapped_module.attn.qkv.weight
                                               ->        blocks.0.attn.qkv.weight
"""

from __future__ import annotations

import torch.nn as nn

__all__ = ["Unit", "WRAPPED", "is_unit", "units", "units_with_params", "clean_name", "module_names", "key_of"]

WRAPPED = "_fsdp_wrapped_module"  # the attribute that holds the wrapped module (torch's name)


class Unit(nn.Module):
    """The base class of :class:`~minifsdp.fsdp.fully_sharded.FullyShardedDataParallel`.

    It holds nothing; it exists so that ``isinstance(m, Unit)`` answers "is this
    an FSDP unit?" without importing the class that implements one.  A unit's
    ``_handle`` (``handle.py``) is None when it owns no parameters of its own.
    """

    _handle = None


def is_unit(module: nn.Module) -> bool:
    return isinstance(module, Unit)


def units(model: nn.Module) -> list[Unit]:
    """Every unit in ``model`` (itself included), outermost first, in ``model.modules()`` order."""
    return [m for m in model.modules() if isinstance(m, Unit)]


def units_with_params(model: nn.Module) -> list[Unit]:
    """The units that own a flat parameter (a unit whose children took every parameter owns none)."""
    return [m for m in units(model) if m._handle is not None]


def clean_name(name: str) -> str:
    """'blocks.0._fsdp_wrapped_module.attn' -> 'blocks.0.attn': the plain model's name."""
    parts = [p for p in name.split(".") if p != WRAPPED]
    return ".".join(parts)


def module_names(model: nn.Module) -> dict[int, str]:
    """``id(module) -> its plain name`` for every module of ``model`` (the first name, if shared)."""
    names: dict[int, str] = {}
    for n, m in model.named_modules(remove_duplicate=False):
        names.setdefault(id(m), clean_name(n))
    return names


def key_of(names: dict[int, str], module: nn.Module, attr: str) -> str:
    """The state-dict key of ``module.<attr>`` under the plain names (``module_names``)."""
    prefix = names[id(module)]
    return f"{prefix}.{attr}" if prefix else attr
