"""The tensors inside a module's inputs and outputs, wherever nested (torch: ``fsdp/_common_utils.py``).

The hooks touch the tensors a module receives and returns (an autograd identity on the inputs, a tensor hook on
the outputs), nested in tuples, lists, dicts, namedtuples or dataclasses.  ``torch.utils._pytree`` treats a
dataclass it was not told about as one opaque leaf: a hook would never see the tensors inside, and backward would
reach the weights with no all-gather before it.  :func:`map_tensors` walks all five and rebuilds the containers.
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
