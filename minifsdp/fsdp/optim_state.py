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

A parameter no unit manages (``ignored_modules`` / ``ignored_states``) is each rank's own, so its state is
too, as torch's: saving gives each rank its own optimizer's state for it (nothing gathered), loading gives
each rank's optimizer the state in the dict that rank passed (with ``rank0_only``: rank 0's, broadcast).

Note (where torch FSDP1 is wrong, on CPU): with ``use_orig_params=True`` and ``offload_to_cpu=True`` (the
default of ``FullOptimStateDictConfig``), torch all-gathers every state name of a sharded unit into one
reused buffer and keeps views of it, since ``.cpu()`` of a CPU tensor is no copy
(``_optim_utils._allgather_orig_param_states``): every positive-dim entry holds the last name's numbers,
Adam's ``exp_avg`` equals its ``exp_avg_sq``, and a resume from it diverges.  Ours gives each its own
(``tests/test_state_dict_parity.py`` holds both).

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
    return full_optim_state_dict(model, optim, rank0_only=cfg.rank0_only, group=group,
                                 offload_to_cpu=cfg.offload_to_cpu)


def full_optim_state_dict(model: nn.Module, optim: torch.optim.Optimizer, rank0_only: bool = False,
                          group=None, table: PieceTable | None = None, offload_to_cpu: bool = False) -> dict:
    """Whole optimizer state under the plain names, torch FSDP1's format and key order (a collective).

    The pieces are gathered over the model's shard group; ``rank0_only``: ranks other than rank 0 of
    ``group`` (default: all ranks, as torch) return ``{}``.  A parameter no unit manages (``ignored_modules``)
    is not gathered: each rank gives its own optimizer's state for it, as torch's
    ``_convert_state_with_flat_params`` / ``_convert_state_with_orig_params`` copy it.
    ``table``: the model's piece table (``param_pieces.piece_table``), if the caller has built it."""
    table = table if table is not None else piece_table(model)
    pieces = _pieces(table)
    unit_of = {r.fqn: r.unit for r in table.rows}  # -1: no unit manages it
    mine, order, local = [], [], {}
    for g in optim.param_groups:
        for p in g["params"]:
            _, where = pieces.get(id(p), (p, []))
            order += [fqn for fqn, *_ in where]
            state = optim.state.get(p, {})
            if where and unit_of.get(where[0][0], 0) < 0:  # this rank's own state, in the optimizer's order
                if state:
                    local[where[0][0]] = {k: v.detach().clone() if torch.is_tensor(v) else v for k, v in state.items()}
                continue
            for fqn, src_lo, src_hi, dst in where:
                if src_hi <= src_lo:
                    continue
                for k, v in state.items():
                    if torch.is_tensor(v) and v.dim() > 0 and v.shape == p.shape:
                        mine.append((fqn, k, dst, v.detach().reshape(-1)[src_lo:src_hi].clone()))
                    else:
                        mine.append((fqn, k, None, v.detach().clone() if torch.is_tensor(v) else v))
    everyone, me = [mine], 0
    if dist.is_initialized():
        over = _group(model) if units(model) else group  # the pieces live in the shard group
        everyone, me = [None] * dist.get_world_size(over), dist.get_rank(over)
        dist.all_gather_object(everyone, mine, group=over)
        if rank0_only and dist.get_rank(group) != 0:
            return {}
    shapes, state = table.shapes, {}
    # A NO_SHARD unit's state is whole on every rank: each rank gives its own, as torch (which gathers nothing
    # there, ``_gather_all_orig_param_state``); the replicas agree unless their gradients were never reduced.
    whole = {r.fqn for r in table.rows if r.unit >= 0 and table.units[r.unit]["strategy"] == "NO_SHARD"}
    for fqn, k, dst, v in (item for rank, per_rank in enumerate(everyone) for item in per_rank
                           if rank == me or item[0] not in whole):
        d = state.setdefault(fqn, {})
        if dst is None:
            d.setdefault(k, v)
            continue
        if k not in d:
            d[k] = torch.zeros(shapes[fqn].numel(), dtype=v.dtype, device=v.device)
        d[k][dst:dst + v.numel()] = v
    orig = any(u["use_orig_params"] for u in table.units)  # (the table's account of the units: no second walk)
    for fqn, d in state.items():
        state[fqn] = _in_torch_order({k: v.view(shapes[fqn]) if torch.is_tensor(v) and v.dim() > 0 else v
                                      for k, v in d.items()},
                                     orig, table.units[unit_of[fqn]]["strategy"] != "NO_SHARD")
    state.update(local)
    if offload_to_cpu:
        state = {f: {k: v.cpu() if torch.is_tensor(v) else v for k, v in d.items()} for f, d in state.items()}
    names = iter(order)
    groups = []
    for g in optim.param_groups:
        count = sum(len(pieces.get(id(p), (p, []))[1]) for p in g["params"])
        groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": [next(names) for _ in range(count)]})
    keys = _orig_key_order(sorted(state), unit_of) if orig else [f for f in order if f in state]
    return {"state": {f: state[f] for f in keys}, "param_groups": groups}


def _in_torch_order(d: dict, orig: bool, sharded: bool) -> dict:
    """One parameter's state in torch's key order: without use_orig_params, positive-dim tensors, 0-dim tensors,
    the rest, each by name (``_unflatten_communicated_optim_state``); with it, the rest, 0-dim tensors, then
    positive-dim tensors, each by name (``_convert_all_state_info``), or the optimizer's own order where nothing
    was gathered (NO_SHARD: ``_gather_all_orig_param_state`` returns it as it is)."""
    if orig and not sharded:
        return d

    def kind(v):
        return 0 if torch.is_tensor(v) and v.dim() > 0 else 1 if torch.is_tensor(v) else 2

    ranks = (2, 1, 0) if orig else (0, 1, 2)
    return {k: d[k] for rank in ranks for k in sorted(d) if kind(d[k]) == rank}


def _orig_key_order(names: list[str], unit_of: dict[str, int]) -> list[str]:
    """torch's order of the state with use_orig_params (``_convert_state_with_orig_params``): over the names
    sorted, those no unit manages as met, then each unit's (in the order its first name is met), sorted."""
    alone = [f for f in names if unit_of[f] < 0]
    by_unit: dict[int, list[str]] = {}
    for f in names:
        if unit_of[f] >= 0:
            by_unit.setdefault(unit_of[f], []).append(f)
    return alone + [f for fs in by_unit.values() for f in fs]


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
