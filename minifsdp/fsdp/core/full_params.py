"""What you do with a sharded model besides training it: look at it whole, clip it, save it.

* ``summon_full_params(model)``: all-gather every unit, show the full parameters under their
  original names, write edits back to the shards on exit.
* ``clip_grad_norm_(model, max_norm)``: the norm of the *whole* gradient, although each rank
  holds only a shard of it:

      rank r:  s_r = sum over its shard of g^2     (local_norm ** 2)
      all:     total = (sum_r s_r) ** 0.5           (one all-reduce of one number)

  computed as torch FSDP1 does (per-tensor norms, stacked, then the all-reduce), bitwise.
* ``full_state_dict(model)``: every parameter whole, original names, loadable into the plain
  model; ``load_full_state_dict`` takes one back.  Both gather one unit at a time, walking the
  modules in ``nn.Module.state_dict``'s order, as torch FSDP1's state-dict hooks.

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
from minifsdp.fsdp.core.state import HandleState, TrainingState
from minifsdp.fsdp.core.units import clean_name, flattened_params, is_unit, units, units_with_params


class _Summoned:
    """One unit inside ``summon_full_params``: gathered and shown on enter; written back and freed on exit."""

    def __init__(self, unit, writeback: bool, shown: bool):
        h = unit._handle
        if h is not None and (unit.training_state not in (TrainingState.IDLE, TrainingState.AWAITING_BACKWARD)
                              or h.gradient.in_flight is not None):
            raise AssertionError(  # torch's type ("Cannot manually unshard parameters during forward/backward")
                f"summon_full_params() while a unit is in {unit.training_state.name} is not supported "
                "(inside a forward, a backward or another summon_full_params); call it between steps")
        self.unit, self.writeback, self.shown = unit, writeback, shown
        self.state = unit.training_state
        # gathered before (the root between forward and backward): stays gathered after, as in torch
        self.kept = h is not None and h.state is HandleState.UNSHARDED and not h.dtypes.casts_params
        self.precision = contextlib.ExitStack()

    def enter(self) -> None:
        self.unit.training_state = TrainingState.SUMMON_FULL_PARAMS
        h = self.unit._handle
        if h is None:
            return  # a unit that owns no parameter
        self.precision.enter_context(h.full_precision())  # fp32, never the low-precision copy (as torch)
        h.unshard()
        if self.shown:
            h.use_full_params()
        elif not self.kept:  # rank0_only, another rank: it only took part in the all-gather
            h.reshard()

    def exit(self) -> None:
        h = self.unit._handle
        if h is not None:
            if self.shown and self.writeback:
                h.write_back()
            if self.shown and not self.kept:
                h.reshard()
            self.precision.close()
            if self.shown:
                h.drop_full_params()
        self.unit.training_state = self.state


@contextlib.contextmanager
def summon_full_params(module: nn.Module, recurse: bool = True, writeback: bool = True, rank0_only: bool = False):
    """Inside: every unit under ``module`` is whole; ``module.blocks[0].attn.qkv.weight`` has its full shape.

    Collective: call it on every rank.  ``writeback=True`` (torch's default) copies in-place edits
    of the full parameters back into each rank's shard.  ``rank0_only=True`` (with
    ``writeback=False``): the other ranks take part in the all-gathers and see their shards.
    ``recurse=False``: only this unit's own parameters, never a child's.
    """
    if rank0_only and writeback:
        raise NotImplementedError("summon_full_params(rank0_only=True) needs writeback=False (as in torch): "
                                  "only rank 0 holds the full parameters to write back from")
    inside = units(module) if recurse else [module] if is_unit(module) else []
    shown = not rank0_only or dist.get_rank() == 0
    records = [_Summoned(u, writeback, shown) for u in inside]
    with torch.no_grad(), contextlib.ExitStack() as stack:
        for r in records:
            r.enter()
            stack.callback(r.exit)
        yield


def grad_norm(grads: list[torch.Tensor], norm_type: float, device: torch.device) -> torch.Tensor:
    """torch FSDP1's local norm: the norm of the per-tensor norms, in fp32, on ``device`` (where the
    all-reduce needs it: the same on every rank, also on one with no gradients)."""
    if not grads:
        return torch.tensor(0.0, device=device)
    per_tensor = [torch.linalg.vector_norm(g.detach(), norm_type, dtype=torch.float32) for g in grads]
    return torch.linalg.vector_norm(torch.stack(per_tensor), norm_type, dtype=torch.float32).to(device)


def clip_grad_norm_(root: nn.Module, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Scale every gradient shard by ``min(1, max_norm / (total_norm + 1e-6))``; return ``total_norm``."""
    if not getattr(root, "is_root", False):
        raise RuntimeError("clip_grad_norm_() is called on the root FSDP module (the one you built the "
                           "optimizer from), after a forward and backward")
    inside = units_with_params(root)
    if all(not u._handle.sharded for u in inside):  # as torch: nothing sharded, the ordinary function
        return torch.nn.utils.clip_grad_norm_(root.parameters(), max_norm, norm_type)
    max_norm, norm_type = float(max_norm), float(norm_type)
    sharded, replicated = [], []
    for u in inside:
        target = sharded if u._handle.sharded else replicated
        target.extend(p.grad for p in u._handle.optimizer_params() if p.grad is not None)
    managed = flattened_params(root)  # parameters FSDP leaves alone count as they are, as torch
    replicated.extend(p.grad for p in root.parameters() if id(p) not in managed and p.grad is not None)
    if not sharded and not replicated:  # still a collective below: every rank takes part
        warnings.warn(f"Called FSDP.clip_grad_norm_() on rank {dist.get_rank()} with no gradients -- returning "
                      f"the total norm in the default dtype {torch.get_default_dtype()}", stacklevel=3)
    group = root.groups.shard
    device = collective_device(group, like=inside[0]._handle.flat_param)
    local = grad_norm(sharded, norm_type, device)
    local_rep = grad_norm(replicated, norm_type, device) if replicated else None
    if norm_type == math.inf:
        total = torch.maximum(local, local_rep) if local_rep is not None else local
        dist.all_reduce(total, op=dist.ReduceOp.MAX, group=group)
    else:
        total = local**norm_type
        dist.all_reduce(total, group=group)
        if local_rep is not None:  # the same on every rank: counted once
            total += local_rep**norm_type
        total = total ** (1.0 / norm_type)
    total = total.to(inside[0]._handle.flat_param.device)  # where torch returns it: the module's device
    clip_coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in sharded + replicated:
        g.mul_(clip_coef.to(g.device, g.dtype))
    dtypes = [g.dtype for g in sharded + replicated]  # returned in the gradients' widest dtype, as torch
    return total.to(functools.reduce(torch.promote_types, dtypes)) if dtypes else total


def buffer_dtype_of(root: nn.Module, module: nn.Module, name: str, buffer: torch.Tensor) -> torch.dtype:
    """The dtype ``module.<name>`` had before mixed precision's ``buffer_dtype`` cast it."""
    step = getattr(root, "_root_step", None)
    return buffer.dtype if step is None else step.buffer_dtypes.get((id(module), name), buffer.dtype)


def _walk(module: nn.Module, visit, gather: bool, writeback: bool = False, rank0_only: bool = False,
          prefix: str = "") -> None:
    """Visit ``module`` and its submodules in ``nn.Module.state_dict``'s order; with ``gather``, each unit is
    gathered while the walk is inside it (alive at once: the units on the path from the root), as torch's."""
    unit = gather and is_unit(module)
    with summon_full_params(module, recurse=False, writeback=writeback,
                            rank0_only=rank0_only) if unit else contextlib.nullcontext():
        visit(module, prefix)
        for name, child in module._modules.items():
            if child is not None:
                _walk(child, visit, gather, writeback, rank0_only, f"{prefix}{name}.")


def _param_names(m: nn.Module, flattened: dict[int, list[str]], flat_ids: set[int]) -> list[str]:
    """``m``'s parameter names as its state dict has them (registered ones, then those flattened away)."""
    registered = [n for n, p in m._parameters.items() if p is not None and id(p) not in flat_ids]
    return registered + [n for n in flattened.get(id(m), []) if n not in registered]


def _persistent_buffers(m: nn.Module) -> list[str]:
    return [n for n, b in m._buffers.items() if b is not None and n not in m._non_persistent_buffers_set]


def full_state_dict(module: nn.Module, rank0_only: bool = False, transform=None) -> "OrderedDict[str, torch.Tensor]":
    """Every parameter (tied ones under both names) and persistent buffer, whole, with the plain model's names.

    In ``module.state_dict()``'s key order.  ``rank0_only``: every rank takes part in the
    all-gathers, rank 0 returns the dict, the others ``{}``.  ``transform`` (of the whole
    parameter, while its unit is gathered) makes the value stored instead.
    """
    out: OrderedDict[str, torch.Tensor] = OrderedDict()
    keep = not rank0_only or dist.get_rank() == 0
    flat_ids = {id(u._handle.flat_param) for u in units_with_params(module)}
    own = {id(p) for p in module.parameters()} - flattened_params(module)  # left alone by FSDP: kept, as torch
    clones: dict[int, tuple] = {}  # a tied parameter is copied once, shown under both names

    def visit(m, prefix):
        if not keep:
            return
        for name in _param_names(m, {}, flat_ids):
            p = m._parameters[name]
            if id(p) not in clones:  # (p, its copy): p kept alive, so that its id is not reused
                full = p.detach() if id(p) in own else p.detach().clone()  # gathered ones are freed after
                clones[id(p)] = (p, transform(full) if transform is not None else full)
            out[clean_name(prefix + name)] = clones[id(p)][1]
        for name in _persistent_buffers(m):  # the module's own, in its dtype before buffer_dtype's cast, as torch
            b = m._buffers[name]
            out[clean_name(prefix + name)] = b.detach().to(buffer_dtype_of(module, m, name, b))

    with torch.no_grad():
        _walk(module, visit, gather=True, rank0_only=rank0_only)
    return out


def load_full_state_dict(module: nn.Module, state_dict) -> None:
    """Copy a full state dict (plain names) into the shards, unit by unit: each rank keeps its slice.

    Keys it does not name are left as they are; the public class checks the keys and shapes
    first, with torch's messages (``minifsdp/fsdp/state_dict_type.py``).
    """
    flat_ids = {id(u._handle.flat_param) for u in units_with_params(module)}

    def load(m, prefix):
        for name in _param_names(m, {}, flat_ids) + _persistent_buffers(m):
            key = clean_name(prefix + name)
            if key in state_dict:
                getattr(m, name).copy_(state_dict[key])

    with torch.no_grad():
        _walk(module, load, gather=True, writeback=True)
