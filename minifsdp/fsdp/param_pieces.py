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

The piece table (:func:`piece_table`) is all of it, computed in one walk of the model: a row per
original parameter (its unit, its offset in the flat buffer, its shape, the range of it this rank
holds, the optimizer state keys of the tensor that holds it), the holders, and what a checkpoint's
manifest says of the model.  A checkpoint save builds it once and every part of the save reads it:

    unit 0 (blocks.0): flat = [ w: offset 0, 6 numbers | b: offset 6, 2 | pad 0 ]   (2 ranks, 4 each)

      flat index   0   1   2   3 | 4   5   6   7
                   w0  w1  w2  w3| w4  w5  b0  b1
                   <-- rank 0 -->|<-- rank 1 -->

      rank 0's rows: PieceRow("w", unit=0, offset=0, shape=(2, 3), lo=0, hi=4, src_lo=0, src_hi=4)
                     PieceRow("b", unit=0, offset=6, shape=(2,),   lo=0, hi=0, src_lo=0, src_hi=0)  none here
      rank 1's rows: PieceRow("w", unit=0, offset=0, shape=(2, 3), lo=4, hi=6, src_lo=0, src_hi=2)
                     PieceRow("b", unit=0, offset=6, shape=(2,),   lo=0, hi=2, src_lo=2, src_hi=4)

    invariant: offset + lo == shard start + src_lo  (the number's place in the flat buffer, two ways)

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
from minifsdp.fsdp.core.units import clean_name, units_with_params

__all__ = ["Piece", "Holder", "PieceRow", "PieceTable", "piece_table", "holders", "module_names", "key_of",
           "state_dict_name"]


CHECKPOINTED = "_checkpoint_wrapped_module"  # torch's checkpoint_wrapper's attribute (activation checkpointing)


def state_dict_name(name: str) -> str:
    """A key of any state dict: the plain model's name, without FSDP's wrapper level (``clean_name``) and without
    the activation-checkpoint wrapper's, whose own state-dict hook drops it in torch (``CheckpointWrapper``);
    ``named_parameters()`` keeps the latter, as torch's does inside ``summon_full_params``."""
    return ".".join(p for p in clean_name(name).split(".") if p != CHECKPOINTED)


def module_names(model: nn.Module) -> dict[int, str]:
    """``id(module) -> its plain name`` for every module of ``model`` (the first name, if shared)."""
    names: dict[int, str] = {}
    for n, m in model.named_modules(remove_duplicate=False):
        names.setdefault(id(m), state_dict_name(n))
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


@dataclass(frozen=True)
class PieceRow:
    """One original parameter as this rank sees it: where it lives and which numbers of it this rank holds.

    ``unit``: index into the model's units with parameters (-1: a parameter FSDP leaves alone, held whole);
    ``offset``: its first index in that unit's flat buffer; numbers ``[lo, hi)`` of it flattened are
    numbers ``[src_lo, src_hi)`` of ``holders[holder].tensor`` (``lo == hi``: this rank holds none of it);
    ``optim_keys``: the optimizer state keys of that tensor (empty without an optimizer or before a step).
    """

    fqn: str
    unit: int
    offset: int
    shape: tuple[int, ...]
    lo: int
    hi: int
    src_lo: int
    src_hi: int
    holder: int
    optim_keys: tuple[str, ...] = ()

    @property
    def held(self) -> bool:
        return self.hi > self.lo


@dataclass(frozen=True)
class PieceTable:
    """Everything a save needs to know of the model's parameters on this rank, built by one walk.

    ``rows``: one per original parameter (every rank lists every name, layout order);
    ``all_holders``: every tensor an optimizer may step, with an empty piece for each original this rank
    holds none of (torch's optimizer state dict lists every name on every rank);
    ``my_holders``: the holders this rank holds numbers of, with only those pieces (what a sharded save
    writes); ``specs`` / ``tied`` / ``buffers`` / ``units``: what the manifest says of the model.
    """

    rows: tuple[PieceRow, ...]
    all_holders: tuple[Holder, ...]
    my_holders: tuple[Holder, ...]
    specs: dict  # {fqn: {"shape": [...], "dtype": "torch.float32"}}, each stored parameter once
    tied: dict  # {tied alias: owner fqn}
    buffers: dict  # {plain name: buffer} of the persistent buffers
    units: tuple[dict, ...]  # each unit's flat layout, for the manifest
    shapes: dict  # {fqn: torch.Size} of every name an optimizer state dict may use


def piece_table(model: nn.Module, optimizer=None) -> PieceTable:
    """The table of pieces of ``model`` on this rank: one walk of its modules and units."""
    names, fsdp_units = module_names(model), units_with_params(model)
    state = optimizer.state if optimizer is not None else {}
    rows, all_holders, my_holders, specs, tied, metas, shapes = [], [], [], {}, {}, [], {}

    for u, unit in enumerate(fsdp_units):
        h, orig = unit._handle, getattr(unit, "use_orig_params", False)
        layout = h.layout
        # the part of the flat buffer this rank holds: its shard, or all of it (NO_SHARD: a layout of 1 rank)
        start, end = layout.shard_range(h.groups.shard_rank if h.sharded else 0)
        writes = _first_replica(unit)
        every, mine, unit_rows = [], [], []
        for slot in layout.slots:
            cut = overlap(slot.offset, slot.numel, start, end)
            lo, hi, src_lo, src_hi = cut if cut is not None else (0, 0, 0, 0)
            fqn = key_of(names, slot.module, slot.name)
            tensor = slot.param if orig else h.flat_param  # what the optimizer steps
            row = PieceRow(fqn, u, slot.offset, tuple(slot.shape), lo, hi, src_lo, src_hi, len(all_holders),
                           tuple(state.get(tensor, {})))
            unit_rows.append(row)
            specs[fqn], shapes[fqn] = {"shape": list(row.shape), "dtype": str(h.flat_param.dtype)}, slot.shape
            if orig:  # the optimizer steps slot.param: a 1-D piece (sharded) or the whole
                one = Piece(fqn, row.lo, row.hi, 0, row.hi - row.lo)
                all_holders.append(Holder(tensor, [one], writes))
                if cut is not None:
                    my_holders.append(Holder(tensor, [one], writes))
            else:  # the optimizer steps the flat shard: the row's numbers of it
                piece = Piece(fqn, row.lo, row.hi, row.src_lo, row.src_hi)
                every.append(piece)
                if cut is not None:
                    mine.append(piece)
        if not orig:
            all_holders.append(Holder(h.flat_param, every, writes))
            my_holders.append(Holder(h.flat_param, mine, writes))
        rows.extend(unit_rows)
        for sh in layout.shared:
            owner = layout.slots[sh.primary]
            tied[key_of(names, sh.module, sh.name)] = key_of(names, owner.module, owner.name)
        metas.append({"strategy": unit.sharding_strategy.name, "use_orig_params": orig,
                      "world_size": layout.world_size, "numel": layout.numel, "padded_numel": layout.padded_numel,
                      "slots": [{"fqn": r.fqn, "shape": list(r.shape), "offset": r.offset} for r in unit_rows]})
    # core.units.flattened_params, without walking the units again
    managed = {id(p) for u in fsdp_units for p in (u._handle.flat_param, *u._handle.optimizer_params())}
    seen: dict[int, str] = {}  # a plain model: every parameter, from its modules (a tied one is listed once)
    buffers = {}
    for mod in model.modules():
        for attr, p in mod._parameters.items() if not fsdp_units else ():
            if p is None:
                continue
            fqn = key_of(names, mod, attr)
            if id(p) in seen:
                tied[fqn] = seen[id(p)]
                continue
            seen[id(p)] = fqn
            specs[fqn] = {"shape": list(p.shape), "dtype": str(p.dtype)}
        for b_name, b in mod._buffers.items():
            if b is not None and b_name not in mod._non_persistent_buffers_set:
                buffers[key_of(names, mod, b_name)] = b
    for name, p in model.named_parameters():  # the holders of the parameters FSDP leaves alone, whole
        shapes.setdefault(state_dict_name(name), p.shape)
        if id(p) not in managed:
            fqn, n = state_dict_name(name), p.numel()
            piece = Piece(fqn, 0, n, 0, n)
            rows.append(PieceRow(fqn, -1, 0, tuple(p.shape), 0, n, 0, n, len(all_holders), tuple(state.get(p, {}))))
            all_holders.append(Holder(p, [piece], True))
            my_holders.append(Holder(p, [piece], True))
    return PieceTable(tuple(rows), tuple(all_holders), tuple(my_holders), specs, tied, buffers, tuple(metas),
                      shapes)


def holders(model: nn.Module, every_slot: bool = False) -> list[Holder]:
    """Every tensor the optimizer may step, with the pieces of original parameters it holds.

    ``every_slot``: also an empty piece (``lo == hi``) for each original this rank holds none of,
    so every rank lists every name in the same order (torch's optimizer state dict does).
    """
    table = piece_table(model)
    return list(table.all_holders if every_slot else table.my_holders)
