"""What you do with a sharded model besides training it: look at it whole, clip it, save it.

* ``FSDP.summon_full_params(model)``: all-gather every unit, show the full
  parameters under their original names, write edits back to the shards on exit.
* ``model.clip_grad_norm_(max_norm)``: the norm of the *whole* gradient,
  although each rank holds only a shard of it:

      rank r:  s_r = sum over its shard of g^2     (local_norm ** 2)
      all:     total = (sum_r s_r) ** 0.5           (one all-reduce of one number)

  computed exactly as torch FSDP1 does (per-tensor norms, stacked, then the
  all-reduce), so the result is torch's to the last bit.
* ``model.state_dict()``: the full state dict, original names, every rank (or
  rank 0 only), loadable into the plain model; ``model.load_state_dict(sd)``
  takes one back.

Note (padding): the zeros that pad a flat parameter never reach a state dict
or a norm's value (they are zero in parameters and gradients alike).
"""

from __future__ import annotations

import contextlib
import math
from collections import OrderedDict

import torch
import torch.distributed as dist
import torch.nn as nn

from minifsdp.fsdp.root import buffer_dtype_of
from minifsdp.fsdp.state import HandleState, TrainingState
from minifsdp.fsdp.units import is_unit, key_of, module_names
from minifsdp.fsdp.units import units_with_params as _units

__all__ = ["summon_full_params", "clip_grad_norm_", "full_state_dict", "load_full_state_dict"]



@contextlib.contextmanager
def summon_full_params(module: nn.Module, recurse: bool = True, writeback: bool = True):
    """Inside: every unit under ``module`` is whole; ``module.blocks[0].attn.qkv.weight`` has its full shape.

    Collective: call it on every rank.  With ``writeback=True`` (torch's default)
    in-place edits to the full parameters are copied back into each rank's shard.
    """
    if recurse:
        units = _units(module)
    else:  # only this unit's own parameters, as torch (never a child's in its place)
        units = [module] if is_unit(module) and module._handle is not None else []
    for u in units:
        if u.training_state not in (TrainingState.IDLE, TrainingState.AWAITING_BACKWARD) or u._handle.pending:
            raise RuntimeError(f"summon_full_params() while a unit is in {u.training_state.name} is not supported "
                               "(inside a forward, a backward or another summon_full_params); call it between steps")
    states = [u.training_state for u in units]
    # A unit gathered before (the root between forward and backward) stays gathered after, as in torch.
    keep = [u._handle.state is HandleState.UNSHARDED and not u._handle.uses_param_mp for u in units]
    with torch.no_grad():
        for u in units:
            u.training_state = TrainingState.SUMMON_FULL_PARAMS
            u._handle.set_full_precision(True)  # fp32, never the low-precision copy (as torch)
            u._handle.unshard()
            u._parameters.pop("_flat_param", None)  # torch shows the original parameters, not the flat one
            u._handle.use_full_params()
    try:
        yield
    finally:
        with torch.no_grad():
            for u, state, kept in zip(units, states, keep):
                if writeback:
                    u._handle.write_back()
                if not kept:
                    u._handle.reshard()
                u._handle.set_full_precision(False)
                u._handle.drop_full_params()
                if not u._handle.use_orig_params:
                    u.register_parameter("_flat_param", u._handle.flat_param)
                u.training_state = state


def _grad_norm(grads: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    """torch FSDP1's local norm: the norm of the per-tensor norms, in fp32."""
    if not grads:
        return torch.tensor(0.0)
    per_tensor = [torch.linalg.vector_norm(g.detach(), norm_type, dtype=torch.float32) for g in grads]
    return torch.linalg.vector_norm(torch.stack(per_tensor), norm_type, dtype=torch.float32)


def clip_grad_norm_(root: nn.Module, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Scale every gradient shard by ``min(1, max_norm / (total_norm + 1e-6))``; return ``total_norm``."""
    if not getattr(root, "is_root", False):
        raise RuntimeError("clip_grad_norm_() is called on the root FSDP module (the one you built the "
                           "optimizer from), after a forward and backward")
    units = _units(root)
    if all(not u._handle.sharded for u in units):  # as torch: nothing sharded, the ordinary function
        return torch.nn.utils.clip_grad_norm_(root.parameters(), max_norm, norm_type)
    max_norm, norm_type = float(max_norm), float(norm_type)
    sharded, replicated = [], []
    for u in units:
        target = sharded if u._handle.sharded else replicated
        tensors = [s.param for s in u._handle.layout.slots] if u._handle.use_orig_params else [u._handle.flat_param]
        target.extend(t.grad for t in tensors if t.grad is not None)
    local = _grad_norm(sharded, norm_type)
    local_rep = _grad_norm(replicated, norm_type) if replicated else None
    group = root.groups.shard
    if norm_type == math.inf:
        total = torch.maximum(local, local_rep) if local_rep is not None else local
        dist.all_reduce(total, op=dist.ReduceOp.MAX, group=group)
    else:
        total = local**norm_type
        dist.all_reduce(total, group=group)
        if local_rep is not None:  # the same on every rank: count it once
            total += local_rep**norm_type
        total = total ** (1.0 / norm_type)
    clip_coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in sharded + replicated:
        g.mul_(clip_coef.to(g.device, g.dtype))
    return total


def full_state_dict(module: nn.Module, rank0_only: bool = False) -> "OrderedDict[str, torch.Tensor]":
    """Every parameter (tied ones under both names) and persistent buffer, whole, with the plain model's names."""
    names = module_names(module)
    out: OrderedDict[str, torch.Tensor] = OrderedDict()

    def key(m, attr):
        return key_of(names, m, attr)

    with summon_full_params(module, writeback=False):
        for u in _units(module):
            layout = u._handle.layout
            for slot in layout.slots:
                out[key(slot.module, slot.name)] = getattr(slot.module, slot.name).detach().clone()
            for sh in layout.shared:
                out[key(sh.module, sh.name)] = out[key(layout.slots[sh.primary].module, layout.slots[sh.primary].name)]
        for m in module.modules():
            for b_name, b in m._buffers.items():
                if b is not None and b_name not in m._non_persistent_buffers_set:  # in its own dtype, as torch
                    out[key(m, b_name)] = b.detach().to(buffer_dtype_of(module, m, b_name, b), copy=True)
    if rank0_only and dist.get_rank() != 0:
        return OrderedDict()
    return out


def load_full_state_dict(module: nn.Module, state_dict, strict: bool = True) -> None:
    """Copy a full state dict (plain names) into the shards: each rank keeps its slice."""
    expected = full_state_dict(module).keys()
    missing, unexpected = set(expected) - set(state_dict), set(state_dict) - set(expected)
    if strict and (missing or unexpected):
        raise RuntimeError(f"load_state_dict: missing keys {sorted(missing)}, unexpected keys {sorted(unexpected)}")
    names = module_names(module)
    with summon_full_params(module, writeback=True), torch.no_grad():
        for m in module.modules():
            prefix = names[id(m)] + "." if names[id(m)] else ""
            tensor_names = list(m._buffers)
            for u in _units(module):
                tensor_names += [s.name for s in u._handle.layout.slots if s.module is m]
            for attr in tensor_names:
                if prefix + attr in state_dict and getattr(m, attr) is not None:
                    getattr(m, attr).copy_(state_dict[prefix + attr])
