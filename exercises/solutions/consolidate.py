"""Consolidation for serving (exercise 3.1): a plain state dict from every rank's flat shards.

``units[i]``: one unit's layout (``{"names", "shapes", "numel"}``); ``shards[i]``: that unit's flat
shard from every rank, in rank order.  Concatenate, cut the padding, cut each parameter as a view
of its own numbers (cloned), give a tied name its owner's tensor, add the buffers.
"""

from __future__ import annotations

import torch

__all__ = ["consolidate_state_dict"]


def consolidate_state_dict(units, shards, buffers, tied):
    """A plain state dict, loadable with ``strict=True`` into the unwrapped model."""
    out = {}
    if len(units) != len(shards):
        raise ValueError("one list of shards per unit")
    for layout, pieces in zip(units, shards):
        flat = torch.cat(list(pieces))[: layout["numel"]]
        offset = 0
        for name, shape in zip(layout["names"], layout["shapes"], strict=True):
            n = torch.Size(shape).numel()
            out[name] = flat[offset: offset + n].view(shape).clone()
            offset += n
    for alias, name in tied.items():
        out[alias] = out[name]
    out.update({k: v.clone() for k, v in buffers.items()})
    return out
