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
  takes one back.  Both gather one unit at a time, walking the modules in
  ``nn.Module.state_dict``'s order, as torch FSDP1's state-dict hooks.

Note (padding): the zeros that pad a flat parameter never reach a state dict
or a norm's value (they are zero in parameters and gradients alike).
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections import OrderedDict

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.modules.module import _IncompatibleKeys

from minifsdp.fsdp.checks import collective_device
from minifsdp.fsdp.root import buffer_dtype_of
from minifsdp.fsdp.state import HandleState, TrainingState
from minifsdp.fsdp.units import clean_name, is_unit
from minifsdp.fsdp.units import units as all_units
from minifsdp.fsdp.units import units_with_params as _units

__all__ = ["summon_full_params", "clip_grad_norm_", "full_state_dict", "load_full_state_dict"]



@contextlib.contextmanager
def summon_full_params(module: nn.Module, recurse: bool = True, writeback: bool = True, rank0_only: bool = False,
                       offload_to_cpu: bool = False, with_grads: bool = False):
    """Inside: every unit under ``module`` is whole; ``module.blocks[0].attn.qkv.weight`` has its full shape.

    Collective: call it on every rank.  With ``writeback=True`` (torch's default)
    in-place edits to the full parameters are copied back into each rank's shard.
    ``rank0_only=True`` (torch's, with ``writeback=False``): the other ranks take part
    in the all-gathers and free the result at once; inside, they see their shards.
    ``with_grads=True`` (``use_orig_params=True`` only, as torch): each parameter's ``.grad``
    is the full gradient too (all-gathered; zeros where a rank had none), the shards'
    gradients come back on exit.  ``offload_to_cpu``: the full parameters are on the CPU
    already when the model is (torch's CPU-only run fails there; ours does nothing).
    """
    if rank0_only and writeback:
        raise NotImplementedError("summon_full_params(rank0_only=True) needs writeback=False (as in torch): "
                                  "only rank 0 holds the full parameters to write back from")
    if with_grads and (offload_to_cpu or any(not u._handle.use_orig_params for u in _units(module))):
        raise NotImplementedError("summon_full_params(with_grads=True) needs use_orig_params=True and "
                                  "offload_to_cpu=False (as in torch)")
    if offload_to_cpu and any(u._handle.flat_param.device.type != "cpu" for u in _units(module)):
        raise NotImplementedError("summon_full_params(offload_to_cpu=True) on an accelerator is not implemented "
                                  "in minifsdp: pass offload_to_cpu=False")
    if recurse:
        units = _units(module)
    else:  # only this unit's own parameters, as torch (never a child's in its place)
        units = [module] if is_unit(module) and module._handle is not None else []
    for u in units:
        if u.training_state not in (TrainingState.IDLE, TrainingState.AWAITING_BACKWARD) or u._handle.pending:
            raise AssertionError(  # torch's type ("Cannot manually unshard parameters during forward/backward")
                f"summon_full_params() while a unit is in {u.training_state.name} is not supported "
                "(inside a forward, a backward or another summon_full_params); call it between steps")
    # A unit that owns no parameter (a root whose children took them all) is in the summon too, as in
    # torch: its named_parameters() shows the plain names.
    idle = [u for u in (all_units(module) if recurse else [module] if is_unit(module) else []) if u not in units]
    idle_states = [u.training_state for u in idle]
    for u in idle:
        u.training_state = TrainingState.SUMMON_FULL_PARAMS
    states = [u.training_state for u in units]
    # A unit gathered before (the root between forward and backward) stays gathered after, as in torch.
    keep = [u._handle.state is HandleState.UNSHARDED and not u._handle.uses_param_mp for u in units]
    shown = not rank0_only or dist.get_rank() == 0
    with torch.no_grad():
        for u, kept in zip(units, keep):
            u.training_state = TrainingState.SUMMON_FULL_PARAMS
            u._handle.set_full_precision(True)  # fp32, never the low-precision copy (as torch)
            u._handle.unshard()
            if not shown:  # rank0_only, another rank: it only took part in the all-gather
                if not kept:
                    u._handle.reshard()
                continue
            u.module._parameters.pop("_flat_param", None)  # torch shows the original parameters, not the flat one
            u._handle.use_full_params()
    grads = [u._handle.show_full_grads() for u in units] if with_grads else []
    try:
        yield
    finally:
        with torch.no_grad():
            for u in units:  # the full gradients let go first: .data and .grad shapes must agree
                if with_grads:
                    for slot in u._handle.layout.slots:
                        slot.param.grad = None
            for u, state, kept in zip(units, states, keep):
                if shown:
                    if writeback:
                        u._handle.write_back()
                    if not kept:
                        u._handle.reshard()
                    u._handle.set_full_precision(False)
                    u._handle.drop_full_params()
                    if with_grads:
                        u._handle.restore_grads(grads[units.index(u)])
                    if not u._handle.use_orig_params:
                        u.module.register_parameter("_flat_param", u._handle.flat_param)
                else:
                    u._handle.set_full_precision(False)
                u.training_state = state
            for u, state in zip(idle, idle_states):
                u.training_state = state


def _grad_norm(grads: list[torch.Tensor], norm_type: float, device: torch.device) -> torch.Tensor:
    """torch FSDP1's local norm: the norm of the per-tensor norms, in fp32, on ``device``.

    ``device``: where the all-reduce needs it (``collective_device``), the same on every
    rank, also on one with no gradients (a CPU zero on a plain "nccl" group would fail).
    """
    if not grads:
        return torch.tensor(0.0, device=device)
    per_tensor = [torch.linalg.vector_norm(g.detach(), norm_type, dtype=torch.float32) for g in grads]
    return torch.linalg.vector_norm(torch.stack(per_tensor), norm_type, dtype=torch.float32).to(device)


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
    managed = {id(u._handle.flat_param) for u in units} | {id(s.param) for u in units for s in u._handle.layout.slots}
    # parameters FSDP leaves alone (ignored_modules): their local gradients count as they are, as torch
    replicated.extend(p.grad for p in root.parameters() if id(p) not in managed and p.grad is not None)
    if not sharded and not replicated:  # still a collective below: every rank takes part
        warnings.warn(f"Called FSDP.clip_grad_norm_() on rank {dist.get_rank()} with no gradients -- returning "
                      f"the total norm in the default dtype {torch.get_default_dtype()}", stacklevel=3)
    group = root.groups.shard
    device = collective_device(group, like=units[0]._handle.flat_param)
    local = _grad_norm(sharded, norm_type, device)
    local_rep = _grad_norm(replicated, norm_type, device) if replicated else None
    if norm_type == math.inf:
        total = torch.maximum(local, local_rep) if local_rep is not None else local
        dist.all_reduce(total, op=dist.ReduceOp.MAX, group=group)
    else:
        total = local**norm_type
        dist.all_reduce(total, group=group)
        if local_rep is not None:  # the same on every rank: count it once
            total += local_rep**norm_type
        total = total ** (1.0 / norm_type)
    total = total.to(units[0]._handle.flat_param.device)  # where torch returns it: the module's device
    clip_coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in sharded + replicated:
        g.mul_(clip_coef.to(g.device, g.dtype))
    return total


def _walk(module: nn.Module, visit, gather: bool, writeback: bool = False, rank0_only: bool = False,
          prefix: str = "") -> None:
    """Visit ``module`` and its submodules in ``nn.Module.state_dict``'s order: own tensors, then children.

    With ``gather``, each unit is gathered (``summon_full_params(unit, recurse=False)``) from
    the moment the walk reaches it until it leaves it, as torch FSDP1's state-dict hooks
    do (``_state_dict_utils.py``): alive at once are the units on the path from the root,
    not every unit of the model.
    """
    unit = gather and is_unit(module)
    with summon_full_params(module, recurse=False, writeback=writeback,
                            rank0_only=rank0_only) if unit else contextlib.nullcontext():
        visit(module, prefix)
        for name, child in module._modules.items():
            if child is not None:
                _walk(child, visit, gather, writeback, rank0_only, f"{prefix}{name}.")


def _flattened_names(module: nn.Module) -> tuple[dict[int, list[str]], dict[tuple[int, str], torch.Size]]:
    """(id(submodule) -> the names its parameters had before flattening, in the order torch's summon
    registers them: its own slots, then its tied names; (id, name) -> the full shape)."""
    names, shapes = {}, {}
    for u in _units(module):
        layout = u._handle.layout
        for s in layout.slots:
            names.setdefault(id(s.module), []).append(s.name)
            shapes[id(s.module), s.name] = s.shape
        for sh in layout.shared:
            names.setdefault(id(sh.module), []).append(sh.name)
            shapes[id(sh.module), sh.name] = layout.slots[sh.primary].shape
    return names, shapes


def _param_names(m: nn.Module, flattened: dict[int, list[str]]) -> list[str]:
    """``m``'s parameter names as its state dict has them (registered ones, then those flattened away)."""
    registered = [n for n, p in m._parameters.items() if p is not None and not getattr(p, "_minifsdp_flat", False)]
    return registered + [n for n in flattened.get(id(m), []) if n not in registered]


def _persistent_buffers(m: nn.Module) -> list[str]:
    return [n for n, b in m._buffers.items() if b is not None and n not in m._non_persistent_buffers_set]


def full_state_dict(module: nn.Module, rank0_only: bool = False, transform=None) -> "OrderedDict[str, torch.Tensor]":
    """Every parameter (tied ones under both names) and persistent buffer, whole, with the plain model's names.

    In ``module.state_dict()``'s key order, gathered unit by unit (:func:`_walk`).  With
    ``rank0_only`` every rank takes part in the all-gathers, only rank 0 copies (the
    others return ``{}``), as torch's ``FullStateDictConfig(rank0_only=True)``.  ``transform``
    (a function of the whole parameter, called while its unit is gathered) makes the
    value stored instead: the SHARDED state dict keeps a chunk (``state_dict_type.py``).
    """
    out: OrderedDict[str, torch.Tensor] = OrderedDict()
    keep = not rank0_only or dist.get_rank() == 0
    clones: dict[int, tuple] = {}  # a tied parameter is copied once, shown under both names

    def visit(m, prefix):
        if not keep:
            return
        for name in _param_names(m, {}):
            p = m._parameters[name]
            if id(p) not in clones:  # (p, its copy): p kept alive, so that its id is not reused
                full = p.detach().clone()
                clones[id(p)] = (p, transform(full) if transform is not None else full)
            out[clean_name(prefix + name)] = clones[id(p)][1]
        for name in _persistent_buffers(m):  # in its own dtype (before buffer_dtype's cast), as torch
            b = m._buffers[name]
            out[clean_name(prefix + name)] = b.detach().to(buffer_dtype_of(module, m, name, b), copy=True)

    with torch.no_grad():
        _walk(module, visit, gather=True, rank0_only=rank0_only)
    return out


def load_full_state_dict(module: nn.Module, state_dict, strict: bool = True) -> _IncompatibleKeys:
    """Copy a full state dict (plain names) into the shards, unit by unit: each rank keeps its slice.

    Returns torch's ``_IncompatibleKeys(missing_keys, unexpected_keys)``; with ``strict``
    either one raises torch's message.  A size mismatch always raises.  Unlike torch, every
    check is made before anything is copied (from the layouts: no all-gather), so a
    refused state dict leaves the model as it was.
    """
    flattened, full_shapes = _flattened_names(module)
    expected: dict[str, torch.Size] = {}

    def expect(m, prefix):
        for name in _param_names(m, flattened):
            expected[clean_name(prefix + name)] = full_shapes.get((id(m), name), getattr(m, name).shape)
        for name in _persistent_buffers(m):
            expected[clean_name(prefix + name)] = m._buffers[name].shape

    _walk(module, expect, gather=False)
    missing = [k for k in expected if k not in state_dict]
    unexpected = [k for k in state_dict if k not in expected]
    errors = []  # torch's messages, in its order
    if strict and missing:
        errors.append("Missing key(s) in state_dict: {}. ".format(", ".join(f'"{k}"' for k in missing)))
    if strict and unexpected:
        errors.append("Unexpected key(s) in state_dict: {}. ".format(", ".join(f'"{k}"' for k in unexpected)))
    errors += [f"size mismatch for {k}: copying a param with shape {state_dict[k].shape} from checkpoint, the "
               f"shape in current model is {shape}." for k, shape in expected.items()
               if k in state_dict and tuple(state_dict[k].shape) != tuple(shape)]
    if errors:
        raise RuntimeError("Error(s) in loading state_dict for {}:\n\t{}".format(
            type(module).__name__, "\n\t".join(errors)))

    def load(m, prefix):
        for name in _param_names(m, {}) + _persistent_buffers(m):
            key = clean_name(prefix + name)
            if key in state_dict:
                getattr(m, name).copy_(state_dict[key])

    with torch.no_grad():
        _walk(module, load, gather=True, writeback=True)
    return _IncompatibleKeys(missing, unexpected)
