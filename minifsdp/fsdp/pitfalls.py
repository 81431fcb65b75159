"""Chapter 6: mistakes that torch FSDP1 lets pass silently (or hangs on), named by ours with their fix.

Each check is one function, called from one line of the class users import (chapter 6 lists the lines):

    check_same_unit_on_all_ranks   called at each unit's wrap (``_make_handle``), before its first collective
                                   (not with ``sync_module_states=True``, whose broadcast compares shapes first).
                                   torch FSDP1: hangs in that collective (NCCL), or gloo aborts the rank.
    check_load_awaits_backward     called by every ``load_state_dict`` of a unit (``load_typed_state_dict``).
                                   torch FSDP1: a LOCAL load is lost (the root computes with the full
                                   parameters it kept); a FULL one breaks the pending backward.
    warn_hybrid_shard_of_one       called at each unit's ``__init__``.
                                   torch FSDP1: turns HYBRID_SHARD into NO_SHARD over the 1-rank shard group,
                                   so the replicas never synchronise.
    check_not_torch_dcp            called by ``state_dict`` and ``load_state_dict`` of the class users import.
                                   torch's ``get_state_dict`` / ``set_state_dict`` know FSDP1 only by torch's
                                   class: on ours they see a plain module (whole values where sharded ones were
                                   asked, optimizer state under ``_flat_param``, a full load refused).

Why the first one works where the collectives themselves hang: ranks that wrap differently issue
collectives of different sizes, or a different number of them, and a collective cannot tell that
its peers are in another one (chapter 2.2's ``agree_on_call`` does, for our ring; not for gloo's or
NCCL's).  So before a unit's first collective every rank all-reduces one fixed-size fingerprint of
what it is about to wrap (its class, parameter shapes and dtypes)::

    rank 0: unit #1 = Linear(8 -> 64)       fingerprint h0 ┐  all-reduce MAX of [h, -h]
    rank 1: unit #1 = the whole Sequential  fingerprint h1 ┘  -> [max h, -min h]: equal iff h0 == h1

The all-reduce is the same size on every rank, so it cannot hang where the unit's own collective would;
when the fingerprints differ, every rank learns it from the same result, gathers each rank's description
and raises the same error, naming every rank.

Note (cost): one all-reduce of two int64 numbers per unit and group, at wrap time only.
"""

from __future__ import annotations

import hashlib
import sys
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn

from minifsdp.comm.devices import collective_device
from minifsdp.fsdp.core.fsdp import TrainingState
from minifsdp.fsdp.core.strategy import ShardingPlan
from minifsdp.fsdp.core.units import units

__all__ = ["check_same_unit_on_all_ranks", "check_load_awaits_backward", "warn_hybrid_shard_of_one",
           "unit_description"]


def unit_description(module: nn.Module, params: list, buffers: list) -> str:
    """What a unit wraps, as the wrap check compares and reports it: class, parameters, elements, dtypes."""
    dtypes = sorted({str(t.dtype).removeprefix("torch.") for t in params}) or ["-"]
    numel = sum(p.numel() for p in params)
    shapes = ", ".join(str(tuple(p.shape)) for p in params[:4]) + (", ..." if len(params) > 4 else "")
    return (f"{type(module).__name__} with {len(params)} parameters ({numel} elements, {'/'.join(dtypes)}: "
            f"{shapes or 'none'}) and {len(buffers)} buffers")


def _fingerprint(module: nn.Module, params: list, buffers: list) -> int:
    """56 bits of a hash of everything that sizes the unit's collectives (fits an int64, and its negative)."""
    key = repr((type(module).__qualname__, [(tuple(t.shape), str(t.dtype)) for t in params],
                [(tuple(t.shape), str(t.dtype)) for t in buffers]))
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=7).digest(), "little")


def check_same_unit_on_all_ranks(groups, module: nn.Module, params: list, buffers: list) -> None:
    """Every rank must be wrapping the same unit now: refuse, on every rank at once, when they are not.

    ``groups``: the unit's ``ShardGroups`` (its shard group, and for HYBRID_SHARD its replicate group);
    ``params`` / ``buffers``: the tensors this unit takes over.  Call it before the unit's first collective.
    """
    mine = _fingerprint(module, params, buffers)
    like = (params + buffers)[0] if params or buffers else None
    for group in filter(None, (groups.shard, groups.replicate)):
        if dist.get_world_size(group) == 1:
            continue
        both = torch.tensor([mine, -mine], dtype=torch.int64, device=collective_device(group, like=like))
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
        highest, lowest = both[0].item(), -both[1].item()
        if highest == lowest:
            continue
        seen = [None] * dist.get_world_size(group)
        dist.all_gather_object(seen, unit_description(module, params, buffers), group=group)
        ranks = dist.get_process_group_ranks(group)
        listed = "; ".join(f"rank {r}: {what}" for r, what in zip(ranks, seen, strict=True))
        raise RuntimeError(
            f"FSDP: the ranks disagree on what this unit wraps ({listed}). Their collectives would not match: "
            "torch's FSDP hangs in the first one (NCCL) or gloo aborts the process. Every rank must build the "
            "same model and wrap it the same way: pass the same auto_wrap_policy on every rank (a setting read "
            "on one rank only, or one that depends on the rank, splits them).")


def _root_of(unit: nn.Module) -> nn.Module:
    root = unit.__dict__.get("_root")  # set at the root's first forward; before it, nothing awaits a backward
    return root if root is not None else unit


def check_load_awaits_backward(unit: nn.Module) -> None:
    """Refuse ``load_state_dict`` while a forward of ``unit``'s root awaits its backward.

    After a forward whose output needs a gradient, the root keeps the full parameters it gathered
    (every unit does, under SHARD_GRAD_OP) until its backward: the backward differentiates those, and
    the next forward uses them again without a gather.  A load writes the shards, so neither would
    see it.  torch FSDP1 keeps the root's full parameters after *any* forward until a backward: a LOCAL
    load after one is lost, silently; a FULL or SHARDED one is written through them, and a pending
    backward then fails inside autograd (its docs warn not to change parameters between forward and
    backward outside ``summon_full_params``).  Ours after a forward under ``no_grad`` (nothing awaits):
    the next forward sees the shards' new version and gathers again (``core/fsdp.py``'s
    ``_root_pre_forward``), so the load arrives and nothing is refused.
    """
    waiting = [u for u in units(_root_of(unit)) if u.training_state is TrainingState.AWAITING_BACKWARD]
    if waiting:
        raise RuntimeError(
            "FSDP: load_state_dict between a forward and its backward. The root keeps the full parameters "
            "it gathered for that forward until the backward, so neither that backward nor the next forward "
            "would use the loaded weights (torch's FSDP1 keeps computing with the old full parameters after a "
            "LOCAL load, silently; after a FULL one its backward fails inside autograd). Load before the forward "
            "or after the backward; run a forward you do not differentiate (a check, an evaluation) under "
            "torch.no_grad().")


def warn_hybrid_shard_of_one(unit: nn.Module) -> None:
    """HYBRID_SHARD with a shard group of one rank: say what it becomes here, and what it becomes in torch."""
    groups = unit.groups
    if not ShardingPlan.of(unit.sharding_strategy).two_groups or groups.shard_size != 1 or groups.replicate is None:
        return
    replicas = dist.get_world_size(groups.replicate)
    if replicas == 1:
        return
    warnings.warn(
        f"FSDP: {unit.sharding_strategy.name} with a shard group of 1 rank shards nothing: every rank holds whole "
        f"units, and the gradients are all-reduced over the replicate group of {replicas} ranks (NO_SHARD's "
        "algorithm). torch's FSDP1 also switches to NO_SHARD here but reduces over the 1-rank shard group, so "
        "its replicas never synchronise: on torch, ask for NO_SHARD (or FULL_SHARD) over all ranks instead.",
        stacklevel=3)


_TORCH_DCP = "torch.distributed.checkpoint.state_dict"


def check_not_torch_dcp() -> None:
    """Raise if torch's ``get_state_dict`` / ``set_state_dict`` is the caller (a walk up the Python stack: a state
    dict is rare, the walk costs microseconds).  Those functions find FSDP1 units with torch's own class
    (``FSDP.fsdp_modules``, ``isinstance(..., FSDP)``), so ours would be read as a plain module: silently the
    wrong dict, not an error, without this check."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_globals.get("__name__") == _TORCH_DCP:
            raise TypeError(
                "torch.distributed.checkpoint.state_dict's get_state_dict/set_state_dict recognise FSDP1 by torch's "
                "class and would treat minifsdp's FullyShardedDataParallel as a plain module (whole tensors for a "
                "sharded dict, optimizer state keyed by _flat_param). Use ours' FSDP1 API, as torch FSDP1 users did "
                "before it: `with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT): model.state_dict()` "
                "and `FSDP.optim_state_dict(model, optim)` (then torch.distributed.checkpoint.save), or use "
                "minifsdp's fully_shard (FSDP2), which get_state_dict supports.")
        frame = frame.f_back
