"""torch FSDP1's constructor keywords, mapped onto ours: code written for torch passes them unchanged.

    FSDP(model, sharding_strategy=None, cpu_offload=CPUOffload(), ignored_modules=[model.head],
         mixed_precision=torch.distributed.fsdp.MixedPrecision(param_dtype=torch.float16),
         backward_prefetch=torch.distributed.fsdp.BackwardPrefetch.BACKWARD_PRE, device_id=torch.device("cpu"))

    keyword                          what it becomes here
    auto_wrap_policy=partial(size_based_auto_wrap_policy, min_num_params=...)
                                     torch's other policy (the core's wrap.py has the transformer one)
    device_mesh=init_device_mesh(...) the process group(s) the core takes (HYBRID: (shard, replicate))
    HYBRID_SHARD, no process_group   torch's groups, built once at the root and shared by the units below it
    and no device_mesh               (:func:`node_groups`): a shard group per node, a node being as many ranks
                                     as the device has devices (``torch.cuda.device_count()``; on the CPU 1)
    sharding_strategy=None           FULL_SHARD (torch reads None so)
    torch's ShardingStrategy, BackwardPrefetch, MixedPrecision
                                     ours, by name / by field (the same meaning)
    cpu_offload=CPUOffload()         nothing to do (offload_params=False)
    CPUOffload(offload_params=True)  refused (RuntimeError, as torch on a CPU-only machine), naming the fix,
                                     at the root's first forward, where torch fails (:func:`check_cpu_offload`)
    ignored_modules / ignored_states their parameters and buffers stay as they are: not flattened,
                                     not sharded, not reduced, not checked; auto-wrap skips them
    nested units that differ in use_orig_params / limit_all_gathers: refused at the root's first
                                     forward (torch's ValueError), :func:`check_homogeneous`
    MixedPrecision                   the core's, plus torch's private ``_module_classes_to_ignore``

Note (mixed precision and BatchNorm, as torch): with an ``auto_wrap_policy`` and a
``MixedPrecision``, every module of a class in ``MixedPrecision._module_classes_to_ignore``
(``_BatchNorm`` by default) becomes its own unit *without* mixed precision, and runs in
fp32: its inputs are cast to fp32 and its outputs back to the input's dtype
(:func:`override_mixed_precision`), with torch's warning.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import CPUOffload  # torch's own class, re-exported (as state_dict_type.py's)
from torch.distributed.utils import _apply_to_tensors
from torch.nn.modules.batchnorm import _BatchNorm

from minifsdp.fsdp.core import mixed_precision as core_mp
from minifsdp.fsdp.core.mixed_precision import cast_floating
from minifsdp.fsdp.core.prefetch import BackwardPrefetch
from minifsdp.fsdp.core.strategy import ShardingPlan, ShardingStrategy
from minifsdp.fsdp.core.units import flattened_params, is_unit

__all__ = ["CPUOffload", "MixedPrecision", "size_based_auto_wrap_policy", "hybrid_groups", "mesh_process_group",
           "node_groups", "devices_per_node",
           "normalize_strategy", "normalize_prefetch", "normalize_mixed_precision", "check_cpu_offload",
           "offloads_params",
           "check_homogeneous", "ignored_params", "wrap_children", "policy_with_mp_overrides",
           "override_mixed_precision"]


@dataclass(frozen=True)
class MixedPrecision(core_mp.MixedPrecision):
    """torch FSDP1's ``MixedPrecision``, every field: the core's, and ``_module_classes_to_ignore`` (with an
    ``auto_wrap_policy``, each module of these classes becomes its own unit in fp32: :func:`override_mixed_precision`).
    """

    _module_classes_to_ignore: Sequence[type] = (_BatchNorm,)


def size_based_auto_wrap_policy(module: nn.Module, recurse: bool, nonwrapped_numel: int,
                                min_num_params: int = int(1e8), force_leaf_modules: set[type] | None = None,
                                exclude_wrap_modules: set[type] | None = None) -> bool:
    """Wrap a module once it holds at least ``min_num_params`` not-yet-wrapped parameters.

    As torch: never look inside ``nn.MultiheadAttention`` (its forward reads its weights
    directly), never wrap a bare ``ModuleList`` / ``ModuleDict`` (no forward to hook).
    """
    force_leaf_modules = {nn.MultiheadAttention} if force_leaf_modules is None else force_leaf_modules
    exclude_wrap_modules = {nn.ModuleList, nn.ModuleDict} if exclude_wrap_modules is None else exclude_wrap_modules
    is_large = nonwrapped_numel >= min_num_params
    if recurse:
        return is_large and not isinstance(module, tuple(force_leaf_modules))
    return is_large and not isinstance(module, tuple(exclude_wrap_modules))


def hybrid_groups(shard_size: int) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """(shard_group, replicate_group) for this rank, for HYBRID_SHARD: shards of ``shard_size`` consecutive ranks.

    Collective (``new_group``); the layout of ``init_device_mesh(device, (world // shard_size, shard_size))``.
    """
    world = dist.get_world_size()
    if shard_size < 1 or world % shard_size:
        raise ValueError(f"HYBRID_SHARD: world size {world} does not split into shard groups of {shard_size} "
                         f"ranks; choose a shard size that divides {world}.")
    rank, mine = dist.get_rank(), {}
    for start in range(0, world, shard_size):  # shard groups: consecutive ranks
        g = dist.new_group(list(range(start, start + shard_size)))
        if start <= rank < start + shard_size:
            mine["shard"] = g
    for col in range(shard_size):  # replicate groups: the same position in every shard group
        g = dist.new_group(list(range(col, world, shard_size)))
        if rank % shard_size == col:
            mine["replicate"] = g
    return mine["shard"], mine["replicate"]


def devices_per_node(module: nn.Module, device_id=None) -> int:
    """How many ranks torch FSDP1 puts on a node: the count of ``device_id``'s kind of device, else of the first
    parameter not on the CPU (``_init_utils.py``'s ``_init_device_handle``, then ``device_count()``).  On the CPU
    ``torch.cpu.device_count()`` is 1: every rank is a node of its own."""
    if device_id is not None:
        kind = "cuda" if isinstance(device_id, int) else torch.device(device_id).type
    else:
        kind = next((p.device.type for p in module.parameters() if p.device.type not in ("cpu", "meta")), "cpu")
    return getattr(torch, kind).device_count()


def node_groups(ranks_per_node: int) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """HYBRID_SHARD's groups when none are given, as torch FSDP1 builds them (``_init_utils.py``'s
    ``_init_intra_and_inter_node_groups``): shard inside a node (ranks 0..n-1, n..2n-1, ...), replicate across
    nodes (the ranks with the same place in theirs).  Collective; the root builds them once, its units share them.

    On the CPU (n = 1) each shard group is one rank: HYBRID_SHARD shards nothing there, and
    :func:`~minifsdp.fsdp.pitfalls.warn_hybrid_shard_of_one` says what that means on torch and on ours."""
    return hybrid_groups(ranks_per_node)


def mesh_process_group(strategy: ShardingStrategy, process_group, device_mesh, auto_wrap_policy=None,
                       ranks_per_node=None):
    """torch's ``device_mesh=`` as the ``process_group`` the core takes: a 1-D mesh's group, or a 2-D
    (replicate, shard) mesh's ``(shard_group, replicate_group)`` for HYBRID_SHARD.  HYBRID_SHARD given neither
    groups nor a mesh: :func:`node_groups` (``ranks_per_node()`` of them) with an ``auto_wrap_policy``, else
    torch's error (``_init_utils.py``'s ``_init_process_group_state``)."""
    if process_group is not None and device_mesh is not None:
        raise ValueError("Cannot pass both process_group and device_mesh at the same time. Please just pass "
                         "only one of them.")
    if device_mesh is None and process_group is None and ShardingPlan.of(strategy).two_groups:
        if auto_wrap_policy is None:  # each FSDP(...) call would build groups of its own
            raise ValueError(f"Manual wrapping with {strategy} requires explicit specification of process group "
                             "or device_mesh (torch's words; each FSDP(...) would build groups of its own): pass "
                             "device_mesh=init_device_mesh(device, (replicate, shard)) or process_group=("
                             "shard_group, replicate_group) (see minifsdp.hybrid_groups).")
        return node_groups(ranks_per_node())
    if device_mesh is None:
        return process_group
    if not ShardingPlan.of(strategy).two_groups:
        if device_mesh.ndim != 1:
            raise ValueError(f"{strategy.name} takes a 1-D device_mesh, got {device_mesh.ndim}-D; "
                             "a 2-D mesh (replicate, shard) is for HYBRID_SHARD")
        return device_mesh.get_group(0)
    if device_mesh.ndim != 2:
        raise ValueError(f"{strategy.name} needs a 2-D device_mesh (replicate dim first, shard second), "
                         f"got {device_mesh.ndim}-D; e.g. init_device_mesh('cpu', (2, 2))")
    return device_mesh.get_group(1), device_mesh.get_group(0)


def normalize_strategy(strategy) -> ShardingStrategy:
    """None -> FULL_SHARD; a name or torch's enum -> ours."""
    if strategy is None:
        return ShardingStrategy.FULL_SHARD
    if isinstance(strategy, str):
        return ShardingStrategy[strategy]
    if not isinstance(strategy, ShardingStrategy) and hasattr(strategy, "name"):
        return ShardingStrategy[strategy.name]
    return strategy


def normalize_prefetch(prefetch):
    if prefetch is not None and not isinstance(prefetch, BackwardPrefetch) and hasattr(prefetch, "name") \
            and prefetch.name in BackwardPrefetch.__members__:
        return BackwardPrefetch[prefetch.name]
    return prefetch


def normalize_mixed_precision(mp):
    """torch's ``MixedPrecision`` or the core's (same fields, or fewer) -> ours."""
    if mp is None or isinstance(mp, MixedPrecision) or type(mp).__name__ != "MixedPrecision":
        return mp
    fields = MixedPrecision.__dataclass_fields__
    return MixedPrecision(**{k: getattr(mp, k) for k in fields if hasattr(mp, k)})


def offloads_params(cpu_offload) -> bool:
    return cpu_offload is not None and getattr(cpu_offload, "offload_params", False)


def check_cpu_offload(cpu_offload) -> None:
    """``CPUOffload(offload_params=True)`` is refused with torch's error type (a RuntimeError, which torch
    FSDP1 raises on a machine without an accelerator, at the first forward), naming the fix.

    Called at the root's first forward (``torch_extension.py``'s ``on_lazy_init``), for every unit, where torch
    fails: so every error torch raises before it comes first, as in torch, also a wrap-time error of an outer
    ``FSDP(...)`` call after an inner unit wrapped by hand (a unit that mixes frozen and trainable parameters)."""
    if offloads_params(cpu_offload):
        raise RuntimeError(
            "FSDP(cpu_offload=CPUOffload(offload_params=True)) is not supported by minifsdp: parameter offload "
            "keeps the shards on the CPU between uses of an accelerator, and on a CPU-only run there is nothing "
            "to offload them from (torch FSDP1 fails there too). Pass cpu_offload=CPUOffload(offload_params=False) "
            "or leave cpu_offload=None.")


def ignored_params(module: nn.Module, ignored_modules=None, ignored_states=None) -> tuple[set, set]:
    """(the ignored modules and all their submodules, the parameters FSDP leaves alone), as torch's."""
    if ignored_modules is not None and ignored_states is not None:
        raise ValueError("Cannot pass both ignored_modules and ignored_states at the same time. "
                         "Please just pass ignored_states.")
    states = list(ignored_states if ignored_states is not None else ignored_modules or [])
    params = {s for s in states if isinstance(s, nn.Parameter)}
    roots = [s for s in states if isinstance(s, nn.Module)]
    if len(params) + len(roots) != len(states):
        raise TypeError("ignored_states expects all nn.Parameter or all nn.Module list elements, got "
                        f"{sorted({type(s).__name__ for s in states})}")
    if any(is_unit(m) for m in roots):
        raise ValueError("`ignored_modules` should not include FSDP modules")
    modules = {m for r in roots for m in r.modules() if not is_unit(m)}
    params |= {p for m in modules for p in m.parameters()}
    for unit in (m for m in module.modules() if is_unit(m)):  # a nested unit's ignored states stay ignored
        for ext in getattr(unit, "_extensions", ()):           # (torch's _get_ignored_modules adds them too)
            modules |= set(getattr(ext, "ignored_modules", ()))
            params |= set(getattr(ext, "ignored_params", ()))
    return modules, params


def wrap_children(module: nn.Module, policy: Callable, wrap: Callable[[nn.Module], nn.Module], ignored=frozenset(),
                  top: bool = True) -> tuple[nn.Module, int]:
    """The core's ``recursive_wrap`` (``core/wrap.py``), as torch's ``_recursive_wrap`` with ``ignored_modules``:
    an ignored module is never wrapped or looked into, and its parameters count for no one."""
    if is_unit(module) or module in ignored:
        return module, 0
    skip = flattened_params(module) | {id(p) for m in ignored for p in m.parameters()}
    nonwrapped = sum(p.numel() for p in module.parameters() if id(p) not in skip)
    if not policy(module=module, recurse=True, nonwrapped_numel=nonwrapped):
        return module, 0
    wrapped_numel = 0
    for name, child in module.named_children():
        new_child, n = wrap_children(child, policy, wrap, ignored, top=False)
        if new_child is not child:
            setattr(module, name, new_child)
        wrapped_numel += n
    if not top and policy(module=module, recurse=False, nonwrapped_numel=nonwrapped - wrapped_numel):
        return wrap(module), nonwrapped
    return module, wrapped_numel


def policy_with_mp_overrides(policy, classes: tuple):
    """torch's ``_or_policy``: also wrap each module of ``classes`` on its own."""
    def wrapped(module, recurse, nonwrapped_numel):
        if policy(module=module, recurse=recurse, nonwrapped_numel=nonwrapped_numel):
            return True
        return recurse or isinstance(module, classes)  # torch's _wrap_module_cls_individually
    return wrapped


def override_mixed_precision(root: nn.Module, classes: tuple) -> None:
    """Run each ``classes`` module of ``root`` in fp32: inputs cast up, outputs back to the input's dtype."""
    found = sorted({type(m).__name__ for m in root.modules() if isinstance(m, classes)})
    for m in root.modules():
        if isinstance(m, classes) and not getattr(m, "_minifsdp_fp32", False):
            m._minifsdp_fp32 = True
            m.register_forward_pre_hook(_cast_inputs_up)
            m.register_forward_hook(_cast_outputs_back)
    if found:
        warnings.warn(f"Both mixed precision and an auto_wrap_policy were specified to FSDP, where the wrapped "
                      f"module has submodules of type: {found}. These modules will be wrapped as separate FSDP "
                      "instances with mixed precision disabled.", stacklevel=3)


def _cast_inputs_up(module, args):
    cast = []  # the dtype of each tensor cast, in torch's walk (_apply_to_tensors: dataclasses, sets too)
    _apply_to_tensors(lambda a: cast.append(a.dtype) or a if a.is_floating_point() and a.dtype != torch.float32
                      else a, args)
    module.__dict__["_minifsdp_input_dtype"] = cast[-1] if cast else None  # torch: the last one cast
    return cast_floating(args, torch.float32)


def _cast_outputs_back(module, args, output):
    dtype = module.__dict__.pop("_minifsdp_input_dtype", None)
    return output if dtype is None else cast_floating(output, dtype)


def check_homogeneous(units: list) -> None:
    """At the root's first forward: every unit must agree on ``use_orig_params`` and ``limit_all_gathers``
    (torch's ValueError, its message, and which units differ)."""
    for attr in ("use_orig_params", "limit_all_gathers"):
        values = {getattr(u, attr) for u in units}
        if len(values) > 1:
            raise ValueError(f"Expects one homogeneous value for {attr} but got {values}: every FSDP unit of one "
                             f"model must be built with the same {attr}= (pass it to the outer FSDP and its "
                             "auto_wrap_policy, or to each nested FSDP alike)")
