"""What an FSDP unit is, how to find the units of a model, and the plain model's names.

A *unit* is one wrapped module: ``FullyShardedDataParallel(module)`` (``fsdp.py``) is a :class:`Unit`.
Code that only asks "is this a unit?" or "which units are in this model?" imports this, not the class.

Wrapping inserts one attribute level per unit, which :func:`clean_name` removes:

    wrapped:  _fsdp_wrapped_module.blocks.0._fsdp_wrapped_module.attn.qkv.weight
    plain:    blocks.0.attn.qkv.weight
"""

import torch.nn as nn

WRAPPED = "_fsdp_wrapped_module"  # the attribute that holds the wrapped module (torch's name)

class Unit(nn.Module):
    """The base of every FSDP unit; its ``_handle`` (``handle.py``) is None when it owns no parameters."""

    _handle = None

    @property
    def module(self) -> nn.Module:
        """The wrapped module (torch's ``FullyShardedDataParallel.module``)."""
        return getattr(self, WRAPPED)

    @property
    def flat_param(self) -> nn.Parameter | None:
        """This unit's local 1-D shard (torch: ``_flat_param``); None if the unit owns no parameters."""
        return self._handle.flat_param if self._handle is not None else None

    @property
    def is_root(self) -> bool:
        """True for the unit whose forward ran first (known after the first forward)."""
        return self._root is self

def is_unit(module: nn.Module) -> bool:
    return isinstance(module, Unit)

def units(model: nn.Module) -> list[Unit]:
    """Every unit in ``model`` (itself included), outermost first, in ``model.modules()`` order."""
    return [m for m in model.modules() if isinstance(m, Unit)]

def units_with_params(model: nn.Module) -> list[Unit]:
    """The units that own a flat parameter."""
    return [m for m in units(model) if m._handle is not None]

def clean_name(name: str) -> str:
    """'blocks.0._fsdp_wrapped_module.attn' -> 'blocks.0.attn': the plain model's name.

    torch's ``clean_tensor_name`` (``_common_utils.py``) removes the same prefix, and activation
    checkpointing's wrapper prefix too."""
    return ".".join(p for p in name.split(".") if p != WRAPPED)

def flattened_params(model: nn.Module) -> set[int]:
    """``id`` of each parameter a unit manages: flat, or stepped in its place (torch's ``_is_fsdp_flattened``)."""
    return {id(p) for u in units_with_params(model) for p in (u._handle.flat_param, *u._handle.optimizer_params())}
