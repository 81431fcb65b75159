"""Chapter 5: ``fully_shard(module)``, FSDP2's per-module API: what one call takes, checks and changes.

Usage, as torch's (bottom-up: each block, then the root)::

    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    loss = model(x, y); loss.backward(); opt.step()

What one call does to ``module`` (or to each module of a list, ``fully_shard([norm, head])``, one group for all):

1. takes the parameters of the module(s) that no earlier ``fully_shard`` call took (a tied weight once, with
   every ``(module, name)`` that holds it; ``ignored_params`` left alone), in torch's order (submodules before
   their parent), and makes one :class:`~minifsdp.fsdp2.param_group.FSDPParamGroup`: each parameter replaced by
   an ``nn.Parameter`` wrapping a torch ``DTensor`` whose local tensor is this rank's rows (see
   :mod:`minifsdp.fsdp2.param`; ``shard_placement_fn`` may pick another dim).  Buffers stay as they are
   (replicated); frozen parameters are sharded and gathered but get no gradient.
2. attaches an :class:`~minifsdp.fsdp2.state.FSDPState` and its forward hooks (the state's docstring says what
   runs when).
3. changes the module's class to ``FSDP<Orig>`` (a subclass made once per class, with
   :class:`~minifsdp.fsdp2.api.FSDPModule` first in its bases), exactly as torch does, so ``model.unshard()`` and
   the setters exist on the module itself and ``isinstance(model, Orig)`` holds.

``reshard_after_forward``: ``None`` (torch's default) means True for every module except the root, which
keeps its parameters from forward to backward (they would be gathered again at once); True / False as given;
an int k (dividing the shard size N) reshards to groups of k consecutive ranks after forward, so backward's
all-gather stays inside k ranks (e.g. one node) at the cost of holding 1/k instead of 1/N in between.

It also records ``"fully_shard"`` in torch's composable-API registry on the module, as torch's does, so that
``replicate()`` applied around it leaves the sharded parameters alone.

Checks, torch's: a container without a forward (``ModuleList``), a module already taken, a 2-D mesh without
dim names, a non-contiguous or 0-dim parameter, a weight tied across two calls (at the first forward), and
``deepcopy`` of a sharded module are refused with torch's exception types.

How ours differs from torch's, on purpose: ``mesh`` may also be a process group (made a 1-D mesh over its
ranks); everything runs on the caller's thread (no streams: on CPU gloo there is nothing to overlap with), so
the collectives are issued in torch's order but never overlap compute, and a prefetch only moves a gather
earlier.  The extra keyword ``collectives`` picks torch's collectives (default, bitwise parity) or our ring
(``"ring"``).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed._composable.contract import REGISTRY_KEY
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from minifsdp.comm import get_collectives
from minifsdp.fsdp2.api import FSDPModule
from minifsdp.fsdp2.mixed_precision import MixedPrecisionPolicy
from minifsdp.fsdp2.param_group import FSDPParamGroup
from minifsdp.fsdp2.state import FSDPState, fsdp_state

__all__ = ["fully_shard", "FSDPModule", "FSDPState", "fsdp_state"]

_FSDP_CLASSES: dict[type, type] = {}
_NO_MIXED_PRECISION = MixedPrecisionPolicy()  # frozen, so safe as a shared default


def _swap_class(module: nn.Module) -> None:
    cls = type(module)
    if issubclass(cls, FSDPModule):
        return
    new_cls = _FSDP_CLASSES.get(cls)
    if new_cls is None:
        new_cls = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {})
        _FSDP_CLASSES[cls] = new_cls
    module.__class__ = new_cls


def _resolve_mesh(mesh, modules: tuple[nn.Module, ...]) -> tuple[DeviceMesh, object, object]:
    """``(device mesh, shard group, replicate group or None)``.

    ``mesh``: None -> the world; a 1-D ``DeviceMesh`` or a process group -> shard over it; a 2-D ``DeviceMesh``
    -> HSDP, dim 0 replicates and dim 1 shards (torch's convention).  A process group becomes a 1-D mesh over its
    ranks (``DeviceMesh.from_group``: no new group is made)."""
    if mesh is None or not isinstance(mesh, DeviceMesh):
        tensors = [t for m in modules for t in (*m.parameters(), *m.buffers())]
        device_type = next((t.device.type for t in tensors if t.device.type != "meta"), "cpu")
        mesh = DeviceMesh.from_group(dist.group.WORLD if mesh is None else mesh, device_type)
    if mesh.ndim == 1:
        return mesh, mesh.get_group(0), None
    if mesh.ndim == 2:
        if mesh.mesh_dim_names is None:
            raise AssertionError("Please init the 2D mesh for HSDP with mesh_dim_names specified")
        return mesh, mesh.get_group(1), mesh.get_group(0)
    raise ValueError(f"fully_shard expects a 1D or 2D DeviceMesh but got {mesh}")


def _post_forward(reshard_after_forward, mesh: DeviceMesh, group):
    """Resolve an int ``reshard_after_forward=k`` as torch does: 1 -> False, N -> True, otherwise True with a
    group of k consecutive ranks (the mesh's ranks laid out as rows of k) to reshard to after forward."""
    if reshard_after_forward is None or isinstance(reshard_after_forward, bool):
        return reshard_after_forward, None
    if not isinstance(reshard_after_forward, int):
        raise ValueError("reshard_after_forward should be a bool or an int representing the group size to reshard "
                         f"to, not {reshard_after_forward}")
    k, n = reshard_after_forward, dist.get_world_size(group)
    if k < 1 or k > n or n % k != 0:
        raise ValueError(f"If passing reshard_after_forward as an int, it should be a factor of {n}, not {k}")
    if k in (1, n):
        return k == n, None
    mine, _ = dist.new_subgroups_by_enumeration(mesh.mesh.view(-1, k).tolist())  # every rank makes every row's
    return True, mine


def _managed_params(modules: tuple[nn.Module, ...], ignored: set[int]):
    """Parameters of ``modules`` and their submodules not already taken by a nested ``fully_shard``, each
    once, in torch's order (depth first, a module after its children), with every (module, name) holding it."""
    managed, visited = [], set()

    def visit(m: nn.Module) -> None:
        if m not in modules and fsdp_state(m) is not None:
            return  # a nested fully_shard took it
        visited.add(m)
        for child in m.children():
            if child not in visited:
                visit(child)
        managed.append(m)

    for m in modules:
        visit(m)
    params, users = [], {}
    for m in managed:
        for name, p in m._parameters.items():
            if p is None or id(p) in ignored or isinstance(p, DTensor):  # a DTensor: sharded by a nested call
                continue
            if p.dim() == 0:
                raise ValueError(f"fully_shard doesn't support scalar parameters. Change {name} to a 1D tensor with "
                                 "numel equal to 1.")
            if id(p) not in users:
                params.append(p)
                users[id(p)] = []
            users[id(p)].append((m, name))
    return params, users


def _placement(param: nn.Parameter, shard_placement_fn) -> Shard:
    placement = None if shard_placement_fn is None else shard_placement_fn(param)
    if placement is None:
        return Shard(0)
    if not isinstance(placement, Shard):
        raise NotImplementedError(f"fully_shard: shard_placement_fn returned {placement}; a Shard(dim) or None")
    return Shard(placement.dim + param.ndim) if placement.dim < 0 else placement


def fully_shard(module: nn.Module | list[nn.Module], *, mesh=None, reshard_after_forward: bool | int | None = None,
                shard_placement_fn: Callable | None = None, mp_policy: MixedPrecisionPolicy = _NO_MIXED_PRECISION,
                offload_policy=None, ignored_params: set | None = None, collectives: str = "torch"):
    """Shard the parameters of ``module`` (or of a list of modules, one group) over ``mesh`` (default: the world)
    and return it.  Call it on each block first, then on the root.  See the module docstring for what it does
    and how it differs from ``torch.distributed.fsdp.fully_shard``."""
    modules = tuple(module) if isinstance(module, (list, tuple)) else (module,)
    for m in modules:
        if isinstance(m, (nn.ModuleList, nn.ModuleDict)) and type(m).forward is nn.Module.forward:
            raise ValueError(f"fully_shard does not support containers that do not implement forward: {m}")
        if fsdp_state(m) is not None:
            raise AssertionError("Each distinct composable distributed API can only be applied to a module once. "
                                 f"fully_shard has already been applied to the following module:\n{m}")
    device_mesh, group, replicate_group = _resolve_mesh(mesh, modules)
    reshard_after_forward, post_forward_group = _post_forward(reshard_after_forward, device_mesh, group)
    offload = offload_policy is not None and hasattr(offload_policy, "pin_memory")  # a CPUOffloadPolicy
    device = torch.device("cpu") if device_mesh.device_type == "cpu" else \
        torch.device(device_mesh.device_type, torch.get_device_module(device_mesh.device_type).current_device())
    if offload and offload_policy.pin_memory:
        torch.empty(1).pin_memory()  # as torch's: pinning needs an accelerator, and says so if there is none
    params, users = _managed_params(modules, {id(p) for p in ignored_params or ()})
    param_group = None
    if params:
        dims = [_placement(p, shard_placement_fn) for p in params]
        placements = [(Shard(d.dim),) if replicate_group is None else (Replicate(), Shard(d.dim)) for d in dims]
        param_group = FSDPParamGroup(params, users, modules, group, get_collectives(collectives), mp_policy,
                                     reshard_after_forward is not False, replicate_group, post_forward_group,
                                     device_mesh, placements, offload, device)
    FSDPState(modules, param_group, mp_policy, auto_reshard=reshard_after_forward is None)
    for m in modules:
        _swap_class(m)
        # torch's composable APIs (replicate(), checkpoint()) learn from this registry that fully_shard owns the
        # module: replicate() then leaves its parameters to us instead of all-reducing their gradients again
        m.__dict__.setdefault(REGISTRY_KEY, {})["fully_shard"] = fully_shard
    return module


fully_shard.state = fsdp_state  # torch's ``fully_shard.state(module)``: the state a call attached
