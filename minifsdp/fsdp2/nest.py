"""Chapter 5: the tensors inside a module's inputs and outputs, wherever the user nested them.

FSDP2's hooks touch the tensors a module receives and returns: mixed precision casts them, the
post-backward hook puts an autograd identity on the inputs, the pre-backward hook is a tensor hook on
the outputs.  A model may pass them in tuples, lists, dicts, namedtuples or dataclasses::

    @dataclass
    class Activations:            # a block returns Activations(h=..., aux=...)
        h: torch.Tensor
        aux: torch.Tensor

``torch.utils._pytree`` flattens the first four but treats a dataclass it was not told about as one opaque
leaf: a hook would never see ``h``, backward would reach the block's weights with no all-gather in front of it,
and autograd would fail on a freed storage.  :func:`map_tensors` walks all five, as torch FSDP2's helper does,
and rebuilds the containers (a dataclass through ``dataclasses.replace``, a namedtuple through its class).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch

__all__ = ["map_tensors", "tensors_in"]


def map_tensors(fn: Callable[[torch.Tensor], Any], tree: Any) -> Any:
    """``tree`` with every tensor ``t`` replaced by ``fn(t)``; containers rebuilt, everything else kept."""
    if isinstance(tree, torch.Tensor):
        return fn(tree)
    if dataclasses.is_dataclass(tree) and not isinstance(tree, type):
        return dataclasses.replace(tree, **{f.name: map_tensors(fn, getattr(tree, f.name))
                                            for f in dataclasses.fields(tree) if f.init})
    if isinstance(tree, dict):
        out = type(tree)() if type(tree) is not dict else {}
        for key, value in tree.items():
            out[key] = map_tensors(fn, value)
        return out
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):  # a namedtuple
        return type(tree)(*(map_tensors(fn, x) for x in tree))
    if isinstance(tree, (list, tuple)):
        return type(tree)(map_tensors(fn, x) for x in tree)
    return tree


def tensors_in(tree: Any) -> list[torch.Tensor]:
    """Every tensor in ``tree``, in :func:`map_tensors`' order."""
    found: list[torch.Tensor] = []
    map_tensors(lambda t: found.append(t) or t, tree)
    return found
