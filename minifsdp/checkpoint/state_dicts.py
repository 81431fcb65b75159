"""State dicts of a sharded model and of its optimizer: full (gathered) or sharded (this rank's pieces).

Under FSDP ``model.state_dict()`` is not one thing: torch asks you to pick a
``StateDictType``.  We offer the two that matter, as plain functions:

    full_state_dict(model)              {fqn: whole tensor}   gathered; loads into the plain model
    sharded_state_dict(model, opt)      {"model": {fqn: 1-D piece}, "optim": ..., "pieces": {fqn: [lo, hi)}}
    full_optim_state_dict(model, opt)   {"state": {fqn: {"exp_avg": whole, "step": ...}}, "param_groups": [...]}
                                        torch FSDP1's ``FSDP.optim_state_dict`` format (keyed by names)

The optimizer under FSDP steps flat shards, so its state is flat-shard shaped and
keyed by the flat parameter; ``model.state_dict()`` says nothing about it.  We map
it back to original names with the same pieces as the parameters
(``pieces.py``).
"""

from __future__ import annotations

from collections import OrderedDict

import torch
import torch.distributed as dist
import torch.nn as nn

from minifsdp.checkpoint.pieces import PieceReader, PieceTable, piece_table
from minifsdp.fsdp import optim_state as fsdp_optim_state
from minifsdp.fsdp.core.units import units
from minifsdp.fsdp.full_state_dict import full_state_dict as _fsdp_full_state_dict

__all__ = ["full_state_dict", "sharded_state_dict", "full_optim_state_dict", "load_full_optim_state_dict",
           "rank_and_world", "all_gather_object"]


def rank_and_world(group=None) -> tuple[int, int]:
    """This rank and the number of ranks in ``group`` (default: all); (0, 1) without a process group."""
    return (dist.get_rank(group), dist.get_world_size(group)) if dist.is_initialized() else (0, 1)


def all_gather_object(obj, group=None) -> list:
    if not dist.is_initialized():
        return [obj]
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def full_state_dict(model: nn.Module, rank0_only: bool = False) -> "OrderedDict[str, torch.Tensor]":
    """Whole tensors under the plain model's names (collective under FSDP: it all-gathers every unit)."""
    if units(model):  # wrapped: gather each unit's flat parameter
        return _fsdp_full_state_dict(model, rank0_only=rank0_only)
    return OrderedDict((k, v.detach().clone()) for k, v in model.state_dict().items())


def _optim_state_of(optimizer, holder) -> dict[str, dict]:
    """{fqn: {key: piece or scalar}} for one holder: tensors shaped like the holder are sliced by piece."""
    state = optimizer.state.get(holder.tensor) if optimizer is not None else None
    if not state:
        return {}
    out = {}
    for piece in holder.pieces:
        d = {}
        for k, v in state.items():
            if torch.is_tensor(v) and v.dim() > 0 and v.shape == holder.tensor.shape:
                d[k] = v.detach().reshape(-1)[piece.src_lo : piece.src_hi].clone()
            else:
                d[k] = v.detach().clone() if torch.is_tensor(v) else v
        out[piece.fqn] = d
    return out


def _param_groups(table: PieceTable, optimizer) -> list[dict]:
    """Hyperparameters per group, with the original names of the parameters in it (as torch FSDP1)."""
    names = {id(h.tensor): [p.fqn for p in h.pieces] for h in table.my_holders}
    groups = []
    for g in optimizer.param_groups:
        groups.append({**{k: v for k, v in g.items() if k != "params"},
                       "params": [f for p in g["params"] for f in names.get(id(p), [])]})
    return groups


def sharded_state_dict(model: nn.Module, optimizer=None, table: PieceTable | None = None) -> dict:
    """This rank's pieces only (no communication).

    Returns ``{"model": {fqn: 1-D tensor}, "optim": {"state": {fqn: {key: ...}}}, "pieces": {fqn: [lo, hi]}}``:
    ``model[fqn]`` holds numbers ``[lo, hi)`` of ``fqn`` flattened; replicas write
    nothing (see the Note in ``pieces.py``).  ``table``: the model's piece table, if the caller has it.
    """
    table = table if table is not None else piece_table(model, optimizer)
    model_sd, optim_state, pieces = {}, {}, {}
    for h in table.my_holders:
        if not h.writes:
            continue
        flat = h.tensor.detach().reshape(-1)
        for p in h.pieces:
            model_sd[p.fqn] = flat[p.src_lo : p.src_hi].clone()
            pieces[p.fqn] = [p.lo, p.hi]
        optim_state.update(_optim_state_of(optimizer, h))
    out = {"model": model_sd, "optim": {"state": optim_state}, "pieces": pieces}
    if optimizer is not None:
        out["optim"]["param_groups"] = _param_groups(table, optimizer)
    return out


def full_optim_state_dict(model: nn.Module, optimizer, rank0_only: bool = True, group=None,
                          table: PieceTable | None = None) -> dict:
    """The optimizer state with whole tensors under original names (collective: gathers every rank's pieces).

    torch FSDP1's ``FSDP.optim_state_dict`` format, and the same function
    (``minifsdp/fsdp/optim_state.py``): gathered over the model's shard group; with ``rank0_only``, ``{}``
    on the ranks other than rank 0 of ``group`` (default: all ranks, as torch's ``full_optim_state_dict``).
    """
    return fsdp_optim_state.full_optim_state_dict(model, optimizer, rank0_only=rank0_only, group=group, table=table)


def load_optimizer_from(reader: PieceReader, model: nn.Module, optimizer, table: PieceTable | None = None) -> None:
    """Rebuild every holder's optimizer state from saved pieces (any layout to any layout)."""
    table = table if table is not None else piece_table(model)

    def pick_key(key):
        return lambda f, q: f["optim"]["state"].get(q, {}).get(key)

    for h in table.my_holders:
        if not h.pieces:
            continue
        first = reader.scalar(h.pieces[0].fqn, lambda f, q: f["optim"]["state"].get(q))
        if first is None:
            continue  # no state saved (the optimizer had not stepped)
        new = {}
        for key, sample in first.items():
            if torch.is_tensor(sample) and sample.dim() > 0:
                buf = torch.zeros(h.tensor.numel(), dtype=sample.dtype, device=h.tensor.device)
                for p in h.pieces:
                    if not reader.fill(buf[p.src_lo : p.src_hi], p.fqn, p.lo, p.hi, pick_key(key)):
                        raise RuntimeError(f"optimizer state {key!r} of {p.fqn} is missing from the checkpoint")
                new[key] = buf.view(h.tensor.shape)
            else:
                new[key] = sample.clone() if torch.is_tensor(sample) else sample
        optimizer.state[h.tensor] = new


def load_param_groups(optimizer, saved_groups: list[dict], where: str) -> None:
    if len(saved_groups) != len(optimizer.param_groups):
        raise RuntimeError(f"{where}: the checkpoint's optimizer has {len(saved_groups)} parameter groups, this "
                           f"one {len(optimizer.param_groups)}; build the optimizer with the same groups")
    for saved, group in zip(saved_groups, optimizer.param_groups):
        for k, v in saved.items():
            if k != "params":
                group[k] = v


def load_full_optim_state_dict(model: nn.Module, optimizer, osd: dict) -> None:
    """Load a full optimizer state dict (ours, or torch FSDP1's ``FSDP.optim_state_dict``) on every rank."""
    optimizer.load_state_dict(fsdp_optim_state.optim_state_for(model, optimizer, osd))
