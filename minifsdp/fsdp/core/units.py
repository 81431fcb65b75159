"""What an FSDP unit is, how to find the units of a model, and the plain model's names.

A *unit* is one wrapped module: ``FullyShardedDataParallel(module)`` (``fsdp.py``) is a
:class:`Unit`.  Code that only asks "is this a unit?" or "which units are in this model?"
(prefetching, checkpoints, the tracer, the plots) imports this small module, not the class.

Wrapping inserts one attribute level per unit, which :func:`clean_name` removes:

    wrapped:  _fsdp_wrapped_module.blocks.0._fsdp_wrapped_module.attn.qkv.weight
    plain:    blocks.0.attn.qkv.weight
"""

import torch.nn as nn

WRAPPED = "_fsdp_wrapped_module"  # the attribute that holds the wrapped module (torch's name)


class Unit(nn.Module):
    """The base of every FSDP unit; its ``_handle`` (``handle.py``) is None when it owns no parameters."""

    _handle = None


def is_unit(module: nn.Module) -> bool:
    return isinstance(module, Unit)


def units(model: nn.Module) -> list[Unit]:
    """Every unit in ``model`` (itself included), outermost first, in ``model.modules()`` order."""
    return [m for m in model.modules() if isinstance(m, Unit)]


def units_with_params(model: nn.Module) -> list[Unit]:
    """The units that own a flat parameter."""
    return [m for m in units(model) if m._handle is not None]


def clean_name(name: str) -> str:
    """'blocks.0._fsdp_wrapped_module.attn' -> 'blocks.0.attn': the plain model's name."""
    return ".".join(p for p in name.split(".") if p != WRAPPED)


def flattened_params(model: nn.Module) -> set[int]:
    """``id`` of every parameter a unit in ``model`` manages: its flat parameter, and the originals it keeps
    as views (``use_orig_params``), as torch's ``_is_fsdp_flattened`` mark."""
    ids = set()
    for u in units_with_params(model):
        ids.add(id(u._handle.flat_param))
        ids.update(id(p) for p in u._handle.optimizer_params())
    return ids
