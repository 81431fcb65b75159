"""Outside the step: what you do with a sharded model besides training it.  Look at it whole, clip it, save it.

The core (``minifsdp/fsdp/core/``) is the training step and nothing else; these three sit on top of it and
work on any unit, the core's class or ``minifsdp.FSDP``:

* ``summon_full_params(model)``: all-gather every unit, show the full parameters under their original
  names, write edits back to the shards on exit (torch's ``_unshard_param_utils.py``); outside autograd.
* ``clip_grad_norm_(model, max_norm)``: the norm of the *whole* gradient, although each rank
  holds only a shard of it:

      rank r:  s_r = sum over its shard of g^2     (local_norm ** 2)
      all:     total = (sum_r s_r) ** 0.5           (one all-reduce of one number)

  computed as torch FSDP1 does (per-tensor norms, stacked, then the all-reduce), bitwise.  Why
  not ``torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)``?  On shards it computes each
  rank's local norm, so every rank clips by a different factor (chapter 3.2).
* ``full_state_dict(model)``: every parameter whole, original names, loadable into the plain
  model: the plain model's state dict, read inside ``summon_full_params``.  (torch's way, one unit
  at a time, loading one back, and torch's other state-dict types: ``full_state_dict.py`` and
  ``state_dict_type.py``.)

Note (padding): the zeros that pad a flat parameter never reach a state dict or a norm's value.
"""

import contextlib
import functools
import math
import warnings
from collections import OrderedDict

import torch
import torch.distributed as dist
import torch.nn as nn

from minifsdp.comm.devices import collective_device
from minifsdp.fsdp.core.flat_param import unflatten
from minifsdp.fsdp.core.fsdp import TrainingState
from minifsdp.fsdp.core.handle import HandleState
from minifsdp.fsdp.core.units import flattened_params, is_unit, units, units_with_params
from minifsdp.fsdp.param_pieces import state_dict_name

__all__ = ["summon_full_params", "clip_grad_norm_", "grad_norm", "full_state_dict"]


# ------------------------------------------------------------------ one unit's full parameters, shown and put away
def show_full_params(h) -> None:
    """Every original name of handle ``h``'s unit becomes an ``nn.Parameter`` of its full shape, sharing the
    full buffer's memory outside autograd (an edit lands in it; :func:`write_back` copies it into the shard)."""
    # torch shows the originals, not the flat parameter
    h.module._parameters.pop("_flat_param", None)
    views = unflatten(h.unsharded.detach(), h.layout)
    params = [nn.Parameter(v, requires_grad=slot.requires_grad) for slot, v in zip(h.layout.slots, views)]
    for slot, p in zip(h.layout.slots, params):
        # the plain attribute would hide the registered one
        slot.module.__dict__.pop(slot.name, None)
        slot.module._parameters[slot.name] = p
    for sh in h.layout.shared:
        sh.module.__dict__.pop(sh.name, None)
        sh.module._parameters[sh.name] = params[sh.primary]


def hide_full_params(h) -> None:
    """Undo :func:`show_full_params`: the names are empty again, ``_flat_param`` registered again."""
    for slot in h.layout.slots + h.layout.shared:
        slot.module._parameters.pop(slot.name, None)
    h.use_sharded_views()
    h.module.register_parameter("_flat_param", h.flat_param)


@contextlib.contextmanager
def full_precision(h):
    """Under mixed precision: gather the fp32 shards into a fp32 buffer; the low-precision buffer and its
    autograd leaf (with its hook) are set aside and put back."""
    if not h.dtypes.casts_params:
        yield
        return
    h.end_use(free=True)
    # fp32: the shards' own dtype
    low, h.padded = (h.padded, h.unsharded), torch.empty(h.layout.padded_numel, dtype=h.dtypes.orig,
                                                         device=h.flat_param.device)
    h.unsharded = h.padded[: h.layout.numel]
    try:
        yield
    finally:
        h.end_use(free=True)
        h.padded, h.unsharded = low


def write_back(h) -> None:
    """Copy this rank's part of the full buffer back into its shard (after edits inside summon_full_params)."""
    if h.frees and h.state is HandleState.UNSHARDED:
        start, end = h.layout.shard_range(h.rank)
        h.flat_param.data.copy_(h.padded[start:end])


@contextlib.contextmanager
def _summoned(unit, writeback: bool, shown: bool):
    """One unit inside ``summon_full_params``: gathered and shown on enter; written back and freed on exit."""
    h, before = unit._handle, unit.training_state  # (IDLE, or AWAITING_BACKWARD between forward and backward)
    # gathered before (the root between forward and backward): stays gathered after, as in torch
    kept = h is not None and h.state is HandleState.UNSHARDED and not h.dtypes.casts_params
    unit.training_state = TrainingState.SUMMON_FULL_PARAMS
    try:
        with full_precision(h) if h is not None else contextlib.nullcontext():  # fp32, never a low-precision copy
            if h is not None:
                for ext in unit._extensions:
                    ext.before_unshard(unit, False)
                h.start_unshard()
                h.wait_unshard()
                if shown:
                    show_full_params(h)
                    for ext in unit._extensions:
                        ext.after_unshard(unit)
                elif not kept:  # rank0_only, another rank: it only took part in the all-gather
                    h.end_use(free=True)
            try:
                yield
            finally:
                if h is not None and shown and writeback:
                    write_back(h)
                if h is not None and shown and not kept:
                    h.end_use(free=True)
        if h is not None and shown:
            hide_full_params(h)
            for ext in unit._extensions:
                ext.after_reshard(unit)
            if kept:  # no gather again at the next use, whatever an edit bumped (torch never gathers a kept
                h.gathered_from = h.shard_version()  # one: with writeback=False its edit stays until the free)
    finally:
        unit.training_state = before


@contextlib.contextmanager
def summon_full_params(module: nn.Module, recurse: bool = True, writeback: bool = True, rank0_only: bool = False):
    """Inside: every unit under ``module`` is whole; ``module.blocks[0].attn.qkv.weight`` has its full shape.
    Collective.  ``writeback`` (torch's default) copies in-place edits into each rank's shard; without it an
    edit never reaches the shard, but a unit whose full buffer was kept gathered (SHARD_GRAD_OP after a forward
    with no backward or under no_sync; the root after its forward) computes with the edit until that buffer is
    next freed, as torch's (``_unshard_fsdp_state_params`` frees only what it gathered); ``rank0_only``
    (with ``writeback=False``): only rank 0 of each unit's shard group sees it whole, the others gather
    and see their shards; ``recurse=False``: this unit only."""
    if rank0_only and writeback:
        raise NotImplementedError("summon_full_params(rank0_only=True) needs writeback=False (as in torch): "
                                  "only rank 0 holds the full parameters to write back from")
    inside = units(module) if recurse else [module] if is_unit(module) else []
    for u in inside:
        if u._handle is not None and (u.training_state not in (TrainingState.IDLE, TrainingState.AWAITING_BACKWARD)
                                      or u._handle.gradient.in_flight is not None):
            raise AssertionError(  # torch's type ("Cannot manually unshard parameters during forward/backward")
                f"summon_full_params() while a unit is in {u.training_state.name} is not supported "
                "(inside a forward, a backward or another summon_full_params); call it between steps")
    with torch.no_grad(), contextlib.ExitStack() as stack:  # exited in reverse: the innermost unit first
        for u in inside:  # with rank0_only, the others gather (a collective) but show their shards
            stack.enter_context(_summoned(u, writeback, shows_full_params(u, rank0_only)))
        yield


def shows_full_params(unit, rank0_only: bool) -> bool:
    """Does this rank see ``unit``'s full parameters inside ``summon_full_params(rank0_only=...)``?  With
    ``rank0_only``, rank 0 of the unit's shard group only (torch's ``fsdp_state.rank``: under HYBRID_SHARD, one
    rank per replica)."""
    return not rank0_only or unit.groups.shard_rank == 0


def grad_norm(grads: list[torch.Tensor], norm_type: float, device: torch.device) -> torch.Tensor:
    """torch FSDP1's local norm: the norm of the per-tensor norms, in fp32, on ``device`` (where the
    all-reduce needs it: the same on every rank, also on one with no gradients)."""
    if not grads:
        return torch.tensor(0.0, device=device)
    per_tensor = [torch.linalg.vector_norm(g.detach(), norm_type, dtype=torch.float32) for g in grads]  # one each
    return torch.linalg.vector_norm(torch.stack(per_tensor), norm_type, dtype=torch.float32).to(device)


def clip_grad_norm_(root: nn.Module, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Scale every gradient shard by ``min(1, max_norm / (total_norm + 1e-6))``; return ``total_norm``
    (torch's ``FullyShardedDataParallel.clip_grad_norm_``, ``fully_sharded_data_parallel.py``)."""
    if is_unit(root) and root._root is None:
        # before any forward: this unit is the root (torch's lazy init)
        root._lazy_init()
    if not getattr(root, "is_root", False):
        raise RuntimeError("clip_grad_norm_() is called on the root FSDP module (the one you built the "
                           "optimizer from), after a forward and backward")
    inside = units_with_params(root)
    if all(not u._handle.sharded for u in inside):  # as torch: nothing sharded, the ordinary function
        return torch.nn.utils.clip_grad_norm_(root.parameters(), max_norm, norm_type)
    max_norm, p = float(max_norm), float(norm_type)
    # Sharded gradients: each rank holds a part, so their norms are summed across ranks.  Replicated ones
    # (NO_SHARD units, parameters no unit manages) are whole on every rank: counted once, after the sum.
    grads = [(u._handle.sharded, q.grad) for u in inside for q in u._handle.optimizer_params() if q.grad is not None]
    managed = flattened_params(root)
    sharded = [g for s, g in grads if s]
    replicated = [g for s, g in grads if not s] + [q.grad for q in root.parameters() if id(q) not in managed
                                                   and q.grad is not None]
    if not sharded and not replicated:  # still a collective below: every rank takes part
        warnings.warn(f"Called FSDP.clip_grad_norm_() on rank {dist.get_rank()} with no gradients -- returning "
                      f"the total norm in the default dtype {torch.get_default_dtype()}", stacklevel=3)
    group, like = root.groups.shard, inside[0]._handle.flat_param
    local = grad_norm(sharded, p, collective_device(group, like=like))  # this rank's part of the sum
    local_rep = grad_norm(replicated, p, local.device) if replicated else None
    if p == math.inf:
        total = torch.maximum(local, local_rep) if local_rep is not None else local
        dist.all_reduce(total, op=dist.ReduceOp.MAX, group=group)
    else:
        total = local**p  # s_r, the sum of |g|^p over this rank's shards (the docstring's picture)
        dist.all_reduce(total, group=group)
        total = (total + local_rep**p if local_rep is not None else total) ** (1.0 / p)
    total = total.to(like.device)  # where torch returns it: the module's device
    clip_coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)  # the same on every rank: the same total
    for g in sharded + replicated:
        g.mul_(clip_coef.to(g.device, g.dtype))
    dtypes = [g.dtype for g in sharded + replicated]  # returned in the gradients' widest dtype, as torch
    return total.to(functools.reduce(torch.promote_types, dtypes)) if dtypes else total


def full_state_dict(module: nn.Module) -> "OrderedDict[str, torch.Tensor]":
    """Every parameter (a tied one under both names) and persistent buffer, whole, under the plain model's names,
    in ``module.state_dict()``'s order: ``nn.Module``'s own state dict, taken inside :func:`summon_full_params`
    and copied before the full parameters are freed.  (``minifsdp.FSDP`` gathers one unit at a time instead, as
    torch does, so that only the units on one path from the root are whole at once: ``full_state_dict.py``.)"""
    with summon_full_params(module, writeback=False):
        return OrderedDict((state_dict_name(k), v.detach().clone()) for k, v in nn.Module.state_dict(module).items())
