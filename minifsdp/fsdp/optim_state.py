"""``FSDP.optim_state_dict`` / ``FSDP.optim_state_dict_to_load``: the optimizer state under original names.

The optimizer under FSDP steps each unit's flat shard (or, with ``use_orig_params=True``, each
original parameter's 1-D piece of it), so its state (Adam's ``exp_avg``, ...) has those shapes.
torch FSDP1's FULL format undoes that:

    optim.state_dict()          {0: {"step": 2., "exp_avg": [shard of unit 0's flat param]}, ...}
    FSDP.optim_state_dict       {"state": {"0.weight": {"step": 2., "exp_avg": 13x5}, ...},
                                 "param_groups": [{"lr": ..., "params": ["0.weight", "0.bias", ...]}]}

Both directions read one map, ``param_pieces.piece_table``: which numbers of which original parameter
each tensor the optimizer steps holds.  Saving all-gathers every rank's pieces
(``all_gather_object``) and pastes them into whole tensors; loading cuts each rank's pieces back
out (no communication, unless ``FullOptimStateDictConfig(rank0_only=True)``: then rank 0's dict is
broadcast first).  ``minifsdp.checkpoint``'s full optimizer state dict is this one.

Only the FULL type is offered (torch's default); SHARDED / LOCAL optimizer state dicts are refused
with the fix (``minifsdp.checkpoint`` saves sharded optimizer state).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import StateDictType

from minifsdp.fsdp.core.units import units
from minifsdp.fsdp.param_pieces import PieceTable, piece_table
from minifsdp.fsdp.state_dict_type import get_state_dict_type

__all__ = ["optim_state_dict", "optim_state_dict_to_load", "full_optim_state_dict", "optim_state_for"]


def _pieces(table: PieceTable) -> dict[int, tuple[torch.Tensor, list]]:
    """id(tensor) -> (tensor, [(fqn, src_lo, src_hi, dst_lo)]) for every tensor an optimizer may step, every
    original listed on every rank in the layout's order (``src_lo == src_hi`` where this rank holds none):
    ``tensor.view(-1)[src_lo:src_hi] == original.view(-1)[dst_lo:dst_lo + n]``."""
    return {id(h.tensor): (h.tensor, [(p.fqn, p.src_lo, p.src_hi, p.lo) for p in h.pieces])
            for h in table.all_holders}


def _full_type(model: nn.Module, what: str):
    settings = get_state_dict_type(model)
    if settings.state_dict_type is not StateDictType.FULL_STATE_DICT:
        raise NotImplementedError(
            f"FSDP.{what} with {settings.state_dict_type.name}: minifsdp gives the FULL optimizer state dict "
            "only. Use FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT), or minifsdp.checkpoint for "
            "sharded optimizer state.")
    return settings.optim_state_dict_config


def _group(model):
    inside = units(model)
    return inside[0].groups.shard if inside else None


def optim_state_dict(model: nn.Module, optim: torch.optim.Optimizer, optim_state_dict=None, group=None) -> dict:
    """torch FSDP1's FULL optimizer state dict: whole tensors under the plain names (a collective)."""
    cfg = _full_type(model, "optim_state_dict")
    return full_optim_state_dict(model, optim, rank0_only=cfg.rank0_only, group=group)


def full_optim_state_dict(model: nn.Module, optim: torch.optim.Optimizer, rank0_only: bool = False,
                          group=None, table: PieceTable | None = None) -> dict:
    """Whole optimizer state under the plain names, torch FSDP1's format and key order (a collective over
    ``group``, default: the model's shard group; ``{}`` on ranks other than 0 with ``rank0_only``).
    ``table``: the model's piece table (``param_pieces.piece_table``), if the caller has built it."""
    table = table if table is not None else piece_table(model)
    pieces = _pieces(table)
    mine, order = [], []
    for g in optim.param_groups:
        for p in g["params"]:
            _, where = pieces.get(id(p), (p, []))
            order += [fqn for fqn, *_ in where]
            state = optim.state.get(p, {})
            for fqn, src_lo, src_hi, dst in where:
                if src_hi <= src_lo:
                    continue
                for k, v in state.items():
                    if torch.is_tensor(v) and v.dim() > 0 and v.shape == p.shape:
                        mine.append((fqn, k, dst, v.detach().reshape(-1)[src_lo:src_hi].clone()))
                    else:
                        mine.append((fqn, k, None, v.detach().clone() if torch.is_tensor(v) else v))
    group = group if group is not None else _group(model)
    everyone = [mine]
    if dist.is_initialized():
        everyone = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, mine, group=group)
        if rank0_only and dist.get_rank(group) != 0:
            return {}
    shapes, state = table.shapes, {}
    for fqn, k, dst, v in (item for per_rank in everyone for item in per_rank):
        d = state.setdefault(fqn, {})
        if dst is None:
            d.setdefault(k, v)
            continue
        if k not in d:
            d[k] = torch.zeros(shapes[fqn].numel(), dtype=v.dtype, device=v.device)
        d[k][dst:dst + v.numel()] = v
    orig = any(u._handle is not None and getattr(u, "use_orig_params", False) for u in units(model))
    for fqn, d in state.items():  # torch's key order: the optimizer's (use_orig_params), else the
        whole = {k: v.view(shapes[fqn]) for k, v in d.items() if torch.is_tensor(v) and v.dim() > 0}
        state[fqn] = {**d, **whole} if orig else {**whole, **{k: v for k, v in d.items() if k not in whole}}
        # gathered (positive-dim) tensors first, then the rest
    names = iter(order)
    groups = []
    for g in optim.param_groups:
        count = sum(len(pieces.get(id(p), (p, []))[1]) for p in g["params"])
        groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": [next(names) for _ in range(count)]})
    keys = sorted(order) if orig else order  # torch's order: by name with use_orig_params, else the parameters'
    return {"state": {f: state[f] for f in keys if f in state}, "param_groups": groups}


def optim_state_dict_to_load(model: nn.Module, optim: torch.optim.Optimizer, optim_state_dict: dict,
                             is_named_optimizer: bool = False, load_directly: bool = False, group=None) -> dict:
    """The FULL dict cut back into this rank's pieces, keyed as ``optim.state_dict()``; ready for
    ``optim.load_state_dict`` (done here if ``load_directly``)."""
    cfg = _full_type(model, "optim_state_dict_to_load")
    if cfg.rank0_only:  # only rank 0 passed the dict: every rank needs it
        box = [optim_state_dict if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(box, src=0)
        optim_state_dict = box[0]
    out = optim_state_for(model, optim, optim_state_dict)
    if load_directly:
        optim.load_state_dict(out)
    return out


def optim_state_for(model: nn.Module, optim: torch.optim.Optimizer, optim_state_dict: dict) -> dict:
    """A full optimizer state dict (ours, or torch FSDP1's) cut into this rank's pieces, keyed as
    ``optim.state_dict()`` (no communication)."""
    saved = optim_state_dict["state"]
    pieces, state, groups, index = _pieces(piece_table(model)), {}, [], 0
    if len(optim_state_dict["param_groups"]) != len(optim.param_groups):
        raise ValueError(f"the optimizer state dict has {len(optim_state_dict['param_groups'])} parameter groups, "
                         f"this optimizer {len(optim.param_groups)}: build it with the same groups")
    for g, saved_group in zip(optim.param_groups, optim_state_dict["param_groups"]):
        ids = []
        for p in g["params"]:
            ids.append(index)
            _, where = pieces.get(id(p), (p, []))
            present = [w for w in where if w[0] in saved]
            if present:
                new = {}
                for k, v in saved[present[0][0]].items():
                    if torch.is_tensor(v) and v.dim() > 0:
                        buf = torch.zeros(p.numel(), dtype=v.dtype, device=p.device)
                        for fqn, src_lo, src_hi, dst in present:
                            full = saved[fqn][k].reshape(-1)
                            buf[src_lo:src_hi] = full[dst:dst + src_hi - src_lo].to(p.device)
                        new[k] = buf.view(p.shape)
                    else:
                        new[k] = v.clone() if torch.is_tensor(v) else v
                state[index] = new
            index += 1
        groups.append({**{k: v for k, v in saved_group.items() if k != "params"}, "params": ids})
    return {"state": state, "param_groups": groups}
