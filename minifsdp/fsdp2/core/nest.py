"""The tensors inside a module's inputs and outputs, wherever nested (torch: ``fsdp/_common_utils.py``).

The hooks touch the tensors that require grad in what a module receives and returns (an autograd identity on the
inputs, a tensor hook on the outputs), in namedtuples, dataclasses (every field), dicts, lists or tuples: torch FSDP2's
walk (``collect_grad_tensors``, ``replace_grad_tensors``).  ``torch.utils._pytree`` takes a dataclass it was not told
about for one leaf: a hook would never see the tensors inside, and backward would reach the weights un-gathered.
"""

import dataclasses
from typing import Any, Callable

import torch

__all__ = ["map_grad_tensors", "grad_tensors"]

def map_grad_tensors(fn: Callable[[torch.Tensor], torch.Tensor], tree: Any) -> Any:
    """``tree`` with each tensor ``t`` that requires grad replaced by ``fn(t)``, in torch's order (a namedtuple before a
    dataclass); as torch's, a container is rebuilt only if something in it changed."""
    if isinstance(tree, torch.Tensor):
        return fn(tree) if tree.requires_grad else tree
    named = isinstance(tree, tuple) and hasattr(tree, "_asdict") and hasattr(tree, "_fields")
    fields = None if named or isinstance(tree, type) or not dataclasses.is_dataclass(tree) else dataclasses.fields(tree)
    old = list(tree) if named else [getattr(tree, f.name) for f in fields] if fields is not None else \
        list(tree.values()) if isinstance(tree, dict) else list(tree) if isinstance(tree, (list, tuple)) else []
    new = [map_grad_tensors(fn, x) for x in old]
    if all(n is o for n, o in zip(new, old)):
        return tree
    if named:
        return type(tree)(*new)
    if fields is not None:  # the changed fields only (replace() refuses an init=False one, as torch's)
        return dataclasses.replace(tree, **{f.name: n for f, n, o in zip(fields, new, old) if n is not o})
    if isinstance(tree, dict):
        return dict(zip(tree, new)) if type(tree) is dict else type(tree)(dict(zip(tree, new)))
    try:
        return type(tree)(new)
    except TypeError:  # a subclass whose __init__ refuses its items: the base type, as torch's
        return list(new) if isinstance(tree, list) else tuple(new)

def grad_tensors(tree: Any) -> list[torch.Tensor]:
    """Every tensor in ``tree`` that requires grad, in :func:`map_grad_tensors`' order."""
    found: list[torch.Tensor] = []
    map_grad_tensors(lambda t: found.append(t) or t, tree)
    return found
