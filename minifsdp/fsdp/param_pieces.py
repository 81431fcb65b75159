"""Which numbers of which original parameter each tensor the optimizer steps holds on this rank.

The optimizer under FSDP steps each unit's flat shard (``use_orig_params=True``: each original's
1-D piece of it), so its state (Adam's ``exp_avg``, ...) has those shapes.  Everything that speaks
of the optimizer state by original names -- ``FSDP.optim_state_dict`` (``optim_state.py``) and the
checkpoints of chapter 4.3 (``minifsdp/checkpoint/``) -- reads this one map:

    unit (blocks.0), 2 ranks:   flat = [ w (6 numbers) | b (2) ]
      rank 0 holds flat_param = flat[0:4]:  Piece("w", lo=0, hi=4, src_lo=0, src_hi=4)
      rank 1 holds flat_param = flat[4:8]:  Piece("w", 4, 6, 0, 2), Piece("b", 0, 2, 2, 4)

``tensor.view(-1)[src_lo:src_hi]`` are numbers ``[lo, hi)`` of the original ``fqn`` flattened.  A
*holder* is a tensor the optimizer steps: a unit's ``flat_param``, an original parameter
(``use_orig_params=True``), or a parameter FSDP leaves alone (whole).

Note (replicas write once): under NO_SHARD every rank holds the whole unit and under HYBRID_SHARD
each shard group is a replica; ``Holder.writes`` is True on global rank 0 (NO_SHARD) or on the
first replica's ranks (HYBRID), so a sharded save stores no number twice.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

from minifsdp.fsdp.core.flat_param import overlap
from minifsdp.fsdp.core.units import clean_name, flattened_params, units_with_params

__all__ = ["Piece", "Holder", "holders", "module_names", "key_of"]


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


@dataclass
class Piece:
    """Numbers ``[lo, hi)`` of parameter ``fqn`` (flattened) live at ``[src_lo, src_hi)`` of the holder."""

    fqn: str
    lo: int
    hi: int
    src_lo: int
    src_hi: int


@dataclass
class Holder:
    tensor: torch.Tensor  # what the optimizer steps
    pieces: list[Piece]
    writes: bool  # does this rank write these pieces in a sharded save (replicas: see Note)


def _first_replica(unit) -> bool:
    h = unit._handle
    if not h.sharded:
        return dist.get_rank(h.groups.shard) == 0
    return h.groups.replicate is None or dist.get_rank(h.groups.replicate) == 0


def holders(model: nn.Module, every_slot: bool = False) -> list[Holder]:
    """Every tensor the optimizer may step, with the pieces of original parameters it holds.

    ``every_slot``: also an empty piece (``lo == hi``) for each original this rank holds none of,
    so every rank lists every name in the same order (torch's optimizer state dict does).
    """
    names, out = module_names(model), []
    for unit in units_with_params(model):
        h = unit._handle
        layout = h.layout
        # the part of the flat buffer this rank holds: its shard, or all of it (NO_SHARD: a layout of 1 rank)
        start, end = layout.shard_range(h.groups.shard_rank if h.sharded else 0)
        writes = _first_replica(unit)
        flat_pieces = []
        for slot in layout.slots:
            cut = overlap(slot.offset, slot.numel, start, end)
            if cut is None and not every_slot:
                continue
            lo, hi, src_lo, src_hi = cut if cut is not None else (0, 0, 0, 0)
            fqn = key_of(names, slot.module, slot.name)
            flat_pieces.append(Piece(fqn, lo, hi, src_lo, src_hi))
            if h.use_orig_params:  # the optimizer steps slot.param: a 1-D piece (sharded) or the whole
                out.append(Holder(slot.param, [Piece(fqn, lo, hi, 0, hi - lo)], writes))
        if not h.use_orig_params:
            out.append(Holder(h.flat_param, flat_pieces, writes))
    managed = flattened_params(model)
    for name, p in model.named_parameters():  # parameters FSDP leaves alone (ignored_modules), whole
        if id(p) not in managed:
            out.append(Holder(p, [Piece(clean_name(name), 0, p.numel(), 0, p.numel())], True))
    return out
