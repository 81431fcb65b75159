"""Chapter 2.3: the source's per-layer activation-size hook, fixed.

The source registers a forward hook that prints
``output.element_size() * output.nelement()``.  That raises AttributeError as
soon as a module returns a tuple (attention blocks, RNNs, Hugging Face layers).
Here every tensor inside the output is summed: a tensor, a tuple, a list, a
dict, None, or anything else (0 bytes).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

__all__ = ["activation_sizes", "register_activation_size_hooks", "tensors_in"]


def tensors_in(obj: Any):
    """Every tensor inside nested tuples / lists / dicts; anything else (None, str, ...) holds none."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from tensors_in(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from tensors_in(v)


def _output_bytes(output: Any) -> int:
    """Bytes of every tensor in a module output: a tensor, tuple, list, dict, None, or anything else (0)."""
    return sum(t.element_size() * t.nelement() for t in tensors_in(output))


def register_activation_size_hooks(model: nn.Module) -> tuple[list, list[tuple[str, str, int]]]:
    """Forward hooks recording each module's output bytes; returns (handles, report).

    ``report`` fills with (qualified name, class name, bytes) as forwards run.
    Remove the hooks with ``for h in handles: h.remove()``.
    """
    report: list[tuple[str, str, int]] = []
    handles = []
    for name, module in model.named_modules():

        def hook(mod, inputs, output, name=name):
            report.append((name or "(root)", mod.__class__.__name__, _output_bytes(output)))

        handles.append(module.register_forward_hook(hook))
    return handles, report


def activation_sizes(model: nn.Module, *inputs: Any, **kwargs: Any) -> list[tuple[str, str, int]]:
    """Run ``model(*inputs, **kwargs)`` once (no grad) and return each module's output bytes, in call order.

    The source's hook did ``output.element_size() * output.nelement()``, which
    raises AttributeError on a module returning a tuple (attention blocks,
    RNNs, Hugging Face layers).  This one sums every tensor inside the output.
    """
    handles, report = register_activation_size_hooks(model)
    try:
        with torch.no_grad():
            model(*inputs, **kwargs)
    finally:
        for h in handles:
            h.remove()
    return report
