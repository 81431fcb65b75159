"""Chapter 5: ``fully_shard(module)``, FSDP2's per-module API: what one call takes, checks and changes.

Usage, as torch's (bottom-up: each block, then the root)::

    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    loss = model(x, y); loss.backward(); opt.step()

What one call does to ``module`` (or to each module of a list, ``fully_shard([norm, head])``, one group for all):

1. checks its arguments as torch's does, and turns them into what the core takes: a
   :class:`~minifsdp.fsdp2.core.MeshInfo` (the shard group, the DTensor label, the data-parallel size) and the
   plugins that carry the rest of torch's options into the step (the table in ``minifsdp/fsdp2/__init__.py``),
   in the order each point of the step calls them: the shard adopted before its hooks are looked for, gradients
   kept for accumulation before another plugin reshapes them, a smaller group's pieces gathered before anything.
2. lets the core take the parameters and shard them as one group, attach the state and its hooks
   (:func:`minifsdp.fsdp2.core.shard_modules`): each parameter becomes an ``nn.Parameter`` holding a torch
   ``DTensor`` whose local tensor is this rank's rows.  Buffers stay as they are (replicated); frozen parameters
   are sharded and gathered but get no gradient.
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
dim names, a non-contiguous or 0-dim parameter, a ``shard_placement_fn`` answer outside the parameter's dims or
not dividing evenly, a weight tied across two calls (at the first forward), and ``deepcopy`` of a sharded module
are refused with torch's exception types.

How ours differs from torch's, on purpose: ``mesh`` may also be a process group (made a 1-D mesh over its
ranks); everything runs on the caller's thread, each collective synchronous (no streams: torch's overlap on a
GPU's streams, and on a CPU are synchronous too), so the collectives are issued in torch's order but never overlap
compute, and a prefetch only moves a gather earlier (FSDP1's core issues its all-gathers with ``async_op=True``:
gloo's thread runs one while the caller computes, ``fsdp/core/prefetch.py``).  The extra keyword ``collectives``
picks torch's collectives (default, bitwise parity) or our ring (``"ring"``).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed._composable.contract import REGISTRY_KEY
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard

from minifsdp.comm import get_collectives
from minifsdp.fsdp2 import pitfalls
from minifsdp.fsdp2.api import FSDPModule, GradientSync
from minifsdp.fsdp2.core import (
    FSDPState,
    MeshInfo,
    MixedPrecisionPolicy,
    TrainingState,
    fsdp_state,
    managed_params,
    shard_modules,
)
from minifsdp.fsdp2.core.state import cast_tensors
from minifsdp.fsdp2.extensions import GatherExtensions
from minifsdp.fsdp2.hsdp import Replicate as ReplicatePlugin
from minifsdp.fsdp2.materialize import Materialize
from minifsdp.fsdp2.offload import CPUOffload
from minifsdp.fsdp2.placement import ShardPlacement, resolve_placements
from minifsdp.fsdp2.reshard import ReshardToGroup

__all__ = ["fully_shard", "FSDPModule", "fsdp_state"]

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


def _hook_modules(state: FSDPState) -> None:
    """``fully_shard([a, b])``: one group for several modules (torch's grouping, e.g. for a weight the two tie).  The
    group is gathered at the first module's pre-forward of a pass and resharded once every module of the call ran;
    if the root's forward ends with some not run (a loss that calls ``model.head`` later, chunk by chunk), the root
    finishes the state (core/state.py), and each later call gathers on its own, as torch's."""
    to_run: set[nn.Module] = set()

    def pre_forward(module: nn.Module, args: tuple, kwargs: dict):
        if state.training_state is not TrainingState.FORWARD:  # a new pass (or a recomputation in backward)
            to_run.clear()
            to_run.update(state.modules)
        return state.pre_forward(module, args, kwargs)

    def post_forward_of(module: nn.Module):
        def hook(hook_module: nn.Module, args: tuple, output):
            if module in to_run:
                to_run.discard(module)
                if not to_run:  # the last module of the call ran
                    return state.post_forward(hook_module, args, output)
            return cast_tensors(output, state.mp_policy.output_dtype)
        return hook

    for module in state.modules:
        module.register_forward_pre_hook(pre_forward, prepend=True, with_kwargs=True)
        module.register_forward_hook(post_forward_of(module), always_call=True)


def _reshard_for_state_dict(group) -> None:
    """``state_dict()`` / ``load_state_dict()`` see the sharded parameters, even right after a forward that kept the
    full ones (``reshard_after_forward=False``), as torch's: a pre-hook on every module holding the group's."""
    for module in {id(m): m for p in group.fsdp_params for m, _ in p.users}.values():
        module.register_state_dict_pre_hook(lambda *a, **k: group.to_sharded())
        module.register_load_state_dict_pre_hook(lambda *a, **k: group.to_sharded())


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
    offload = offload_policy is not None and hasattr(offload_policy, "pin_memory")  # ours or torch's CPUOffloadPolicy
    device = torch.device("cpu") if device_mesh.device_type == "cpu" else \
        torch.device(device_mesh.device_type, torch.get_device_module(device_mesh.device_type).current_device())
    if offload and offload_policy.pin_memory:
        torch.empty(1).pin_memory()  # as torch's: pinning needs an accelerator, and says so if there is none
    ignored = {id(p) for p in ignored_params or ()}
    shard_size = dist.get_world_size(group)
    params, users = managed_params(modules, ignored)  # the originals, before sharding replaces them
    placements = resolve_placements(modules, params, shard_size, shard_placement_fn)
    plugins = [Materialize(), GradientSync()]  # in the order each point calls them (core/plugin.py)
    if post_forward_group is not None:
        plugins.append(ReshardToGroup(post_forward_group))
    plugins.append(GatherExtensions())
    if placements:
        plugins.append(ShardPlacement(placements))
    if offload:
        plugins.append(CPUOffload())
    if replicate_group is None:
        mesh_info = MeshInfo(group, device_mesh, (Shard(0),))
    else:
        mesh_info = MeshInfo(group, device_mesh, (Replicate(), Shard(0)),
                             shard_size * dist.get_world_size(replicate_group))
        plugins.append(ReplicatePlugin(replicate_group))
    state = shard_modules(modules, mesh_info, comm=get_collectives(collectives), device=device,
                          reshard_after_forward=reshard_after_forward, mp_policy=mp_policy, ignored=ignored,
                          plugins=plugins)
    pitfalls.watch(modules, params, users)  # ch 6: an optimizer left holding these (fsdp2/pitfalls.py)
    if len(modules) > 1:
        _hook_modules(state)
    if state.param_group is not None:
        _reshard_for_state_dict(state.param_group)
    for m in modules:
        _swap_class(m)
        # torch's composable APIs (replicate(), checkpoint()) learn from this registry that fully_shard owns the
        # module: replicate() then leaves its parameters to us instead of all-reducing their gradients again
        m.__dict__.setdefault(REGISTRY_KEY, {})["fully_shard"] = fully_shard
    return module


fully_shard.state = fsdp_state  # torch's ``fully_shard.state(module)``: the state a call attached
