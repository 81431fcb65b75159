"""The full state dict, one unit at a time, as torch FSDP1's state-dict hooks take it.

``full_params.full_state_dict`` gathers every unit at once and reads the plain model's state dict:
the idea in three lines.  torch walks the modules in ``nn.Module.state_dict``'s order and gathers
each unit only while the walk is inside it, so at most the units on one path from the root are
whole at once:

    root gathered ----------------------------------------------------------- freed
         blocks.0 gathered ------ freed   blocks.1 gathered ------ freed

That walk is here, with torch's options: ``rank0_only`` (every rank gathers, rank 0 of the shard
group keeps the dict, the others only what no unit holds), buffers in their dtype before
``MixedPrecision.buffer_dtype``'s cast, parameters no unit manages kept as they are
(``ignored_modules``), a ``transform`` of each whole parameter (the checkpoints' pieces), and
loading one back into the shards.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict

import torch
import torch.nn as nn

from minifsdp.fsdp.core.units import flattened_params, is_unit, units_with_params
from minifsdp.fsdp.full_params import shows_full_params, summon_full_params
from minifsdp.fsdp.param_pieces import state_dict_name

__all__ = ["full_state_dict", "load_full_state_dict_into_shards", "buffer_dtype_of"]


def buffer_dtype_of(root: nn.Module, module: nn.Module, name: str, buffer: torch.Tensor) -> torch.dtype:
    """The dtype ``module.<name>`` had before mixed precision's ``buffer_dtype`` cast it."""
    step = getattr(root, "_root_state", None)
    return buffer.dtype if step is None else step.buffer_dtypes.get((id(module), name), buffer.dtype)


def _walk(module: nn.Module, visit, gather: bool, writeback: bool = False, rank0_only: bool = False,
          prefix: str = "") -> None:
    """Visit ``module`` and its submodules in ``nn.Module.state_dict``'s order; with ``gather``, each unit is
    gathered while the walk is inside it (alive at once: the units on the path from the root), as torch's."""
    with summon_full_params(module, recurse=False, writeback=writeback, rank0_only=rank0_only) \
            if gather and is_unit(module) else contextlib.nullcontext():
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
    """Every parameter (tied ones under both names) and persistent buffer, whole, with the plain model's names,
    in ``module.state_dict()``'s key order.  ``transform`` (of the whole parameter, while its unit is gathered)
    makes the value stored instead.

    ``rank0_only``: every rank takes part in the all-gathers; the ranks that are not rank 0 of a unit's shard
    group (under HYBRID_SHARD, rank 0 of each replica keeps it all, as torch's ``fsdp_state.rank``) drop what
    that unit holds: the parameters it manages and every buffer under it (torch's
    ``_common_unshard_post_state_dict_hook``).  What no unit with parameters holds stays on every rank, as
    torch's: the parameters of an ignored module (the rank's own), and buffers outside every such unit."""
    out: OrderedDict[str, torch.Tensor] = OrderedDict()
    flat_ids = {id(u._handle.flat_param) for u in units_with_params(module)}
    own = {id(p) for p in module.parameters()} - flattened_params(module)  # no unit manages them: kept, as torch
    dropping = [u for u in units_with_params(module) if rank0_only and not shows_full_params(u, rank0_only)]
    dropped = {(id(s.module), s.name) for u in dropping for s in (*u._handle.layout.slots, *u._handle.layout.shared)}
    no_buffers = {id(m) for u in dropping for m in u.modules()}
    clones: dict[int, tuple] = {}  # a tied parameter is copied once, shown under both names

    def visit(m, prefix):
        for name in _param_names(m, {}, flat_ids):
            p = m._parameters[name]
            if (id(m), name) in dropped and id(p) not in own:
                continue
            if id(p) not in clones:  # (p, its copy): p kept alive, so that its id is not reused
                if id(p) in own:  # the module's own tensor, untransformed (torch's SHARDED keeps it too)
                    clones[id(p)] = (p, p.detach())
                else:  # gathered ones are freed after: copied
                    full = p.detach().clone()
                    clones[id(p)] = (p, transform(full) if transform is not None else full)
            out[state_dict_name(prefix + name)] = clones[id(p)][1]
        for name in _persistent_buffers(m) if id(m) not in no_buffers else []:  # in its dtype before
            b = m._buffers[name]  # buffer_dtype's cast, as torch
            out[state_dict_name(prefix + name)] = b.detach().to(buffer_dtype_of(module, m, name, b))

    with torch.no_grad():
        _walk(module, visit, gather=True, rank0_only=rank0_only)
    return out


def load_full_state_dict_into_shards(module: nn.Module, state_dict) -> None:
    """Copy a full state dict (plain names) into the shards, unit by unit: each rank keeps its slice.  Keys it
    does not name are left as they are (``state_dict_type.load_full_state_dict`` checks keys and shapes first)."""
    flat_ids = {id(u._handle.flat_param) for u in units_with_params(module)}

    def load(m, prefix):
        for name in _param_names(m, {}, flat_ids) + _persistent_buffers(m):
            if state_dict_name(prefix + name) in state_dict:
                getattr(m, name).copy_(state_dict[state_dict_name(prefix + name)])

    with torch.no_grad():
        _walk(module, load, gather=True, writeback=True)
