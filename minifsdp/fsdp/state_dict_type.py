"""``FSDP.state_dict_type``: which state dict ``model.state_dict()`` returns, as torch FSDP1 (chapter 4.3).

    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, FullStateDictConfig(rank0_only=True)):
        sd = model.state_dict()            # whole tensors, plain names (rank 0; see full_state_dict.py)
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        sd = model.state_dict()            # {name: DTensor}: this rank's dim-0 chunk of each parameter
        model.load_state_dict(sd)

    type      model.state_dict() holds                         loads by
    FULL      {plain name: whole tensor} (full_state_dict.py)     copying each rank's slice into its shard
    SHARDED   {plain name: DTensor, Shard(0)}, buffers whole   all-gathering the chunks, then as FULL
    LOCAL     {unit path + "_flat_param": local flat shard}    copying straight into the flat shard

Each maps onto the same walk: FULL is ``full_state_dict.full_state_dict``;
SHARDED gathers one unit at a time the same way and keeps the chunk
``torch.chunk(param, N)[r]`` of each parameter (torch's layout for it); LOCAL
reads the flat parameter itself.  Parameters no unit manages (``ignored_modules``, a module
FSDP skips) are the module's own tensors under every type, as torch's (with ``rank0_only``, on
every rank).  A NO_SHARD unit (FSDP on one rank too) gives and loads FULL with the default config
whatever was set (``rank0_only`` ignored: every rank gets it all), as torch's.

Buffers under ``MixedPrecision(buffer_dtype=...)``, as torch's: FULL and SHARDED show them cast back to the
dtype they had before that cast, LOCAL as the module holds them (in ``buffer_dtype``).  Before the first
forward, taking or loading a state dict first does what that forward would (torch's state-dict hooks begin
with its ``_lazy_init``): the unit becomes the root and the buffers are cast, so FULL shows each buffer
rounded through ``buffer_dtype`` and back.

Note (torch's enum and config classes, not copies): ``StateDictType``,
``FullStateDictConfig``, ``ShardedStateDictConfig``, ``LocalStateDictConfig``, the
``*OptimStateDictConfig`` and ``StateDictSettings`` are torch's own
(``torch.distributed.fsdp``), re-exported.  They are plain data with no FSDP
machinery behind them, and user code imports them from torch: with the same
classes, ``StateDictType.FULL_STATE_DICT`` from either import works on our FSDP,
and ``isinstance(cfg, FullStateDictConfig)`` holds for both.

Note (where we differ from torch, on purpose): SHARDED values are ``DTensor`` s
(torch's public sharded tensor; torch FSDP1 returns the older ``ShardedTensor``,
which it warns is deprecated, unless ``_use_dtensor``), with the same local chunk,
loadable by ``torch.distributed.checkpoint``.  LOCAL values are torch's: a
``ShardedTensor`` per flat parameter whose one local shard is a view of this rank's
flat shard without its padding (torch has no DTensor form of a flat parameter).
"""

from __future__ import annotations

import contextlib
import warnings
from collections import OrderedDict

import torch
import torch.nn as nn
from torch.distributed._shard.sharded_tensor import Shard as LocalShard
from torch.distributed._shard.sharded_tensor import ShardedTensor, init_from_local_shards
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (
    FullOptimStateDictConfig,
    FullStateDictConfig,
    LocalOptimStateDictConfig,
    LocalStateDictConfig,
    OptimStateDictConfig,
    ShardedOptimStateDictConfig,
    ShardedStateDictConfig,
    StateDictConfig,
    StateDictSettings,
    StateDictType,
)
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.nn.modules.module import _IncompatibleKeys

from minifsdp.fsdp import full_state_dict as full_sd
from minifsdp.fsdp import pitfalls
from minifsdp.fsdp.core.strategy import ShardingStrategy
from minifsdp.fsdp.core.units import Unit, flattened_params, units, units_with_params
from minifsdp.fsdp.full_state_dict import full_state_dict, load_full_state_dict_into_shards
from minifsdp.fsdp.param_pieces import state_dict_name

__all__ = ["load_full_state_dict", "StateDictType", "StateDictConfig", "FullStateDictConfig",
           "ShardedStateDictConfig",
           "LocalStateDictConfig", "OptimStateDictConfig", "FullOptimStateDictConfig",
           "ShardedOptimStateDictConfig", "LocalOptimStateDictConfig", "StateDictSettings",
           "set_state_dict_type", "get_state_dict_type", "state_dict_type", "settings_of",
           "typed_state_dict", "load_typed_state_dict"]

_CONFIGS = {
    StateDictType.FULL_STATE_DICT: (FullStateDictConfig, FullOptimStateDictConfig),
    StateDictType.SHARDED_STATE_DICT: (ShardedStateDictConfig, ShardedOptimStateDictConfig),
    StateDictType.LOCAL_STATE_DICT: (LocalStateDictConfig, LocalOptimStateDictConfig),
}
_DEFAULT = StateDictSettings(StateDictType.FULL_STATE_DICT, FullStateDictConfig(), FullOptimStateDictConfig())


def _flattened_names(module: nn.Module) -> tuple[dict[int, list[str]], dict[tuple[int, str], torch.Size]]:
    """(id(submodule) -> the names its parameters had before flattening, in the order summon registers
    them: its own slots, then its tied names; (id, name) -> the full shape)."""
    names, shapes = {}, {}
    for u in units_with_params(module):
        layout = u._handle.layout
        for s in layout.slots:
            names.setdefault(id(s.module), []).append(s.name)
            shapes[id(s.module), s.name] = s.shape
        for sh in layout.shared:
            names.setdefault(id(sh.module), []).append(sh.name)
            shapes[id(sh.module), sh.name] = layout.slots[sh.primary].shape
    return names, shapes


def load_full_state_dict(module: nn.Module, state_dict, strict: bool = True) -> _IncompatibleKeys:
    """The core's ``load_full_state_dict`` after torch's checks: returns ``_IncompatibleKeys``; ``strict``
    raises torch's message for either list, and a size mismatch always raises.  Every check comes before
    anything is copied (from the layouts: no all-gather), so a refused state dict leaves the model as it was."""
    flattened, full_shapes = _flattened_names(module)
    flat_ids = {id(u._handle.flat_param) for u in units_with_params(module)}
    expected: dict[str, torch.Size] = {}

    def expect(m, prefix):
        for name in full_sd._param_names(m, flattened, flat_ids):
            expected[state_dict_name(prefix + name)] = full_shapes.get((id(m), name), getattr(m, name).shape)
        for name in full_sd._persistent_buffers(m):
            expected[state_dict_name(prefix + name)] = m._buffers[name].shape

    full_sd._walk(module, expect, gather=False)
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
    load_full_state_dict_into_shards(module, state_dict)
    return _IncompatibleKeys(missing, unexpected)



def settings_of(unit: nn.Module) -> StateDictSettings:
    """A unit's state-dict settings (torch's default until set: FULL, default configs)."""
    return unit.__dict__.get("_state_dict_settings", _DEFAULT)


def set_state_dict_type(module: nn.Module, state_dict_type: StateDictType, state_dict_config=None,
                        optim_state_dict_config=None) -> StateDictSettings:
    """Set every unit under ``module`` (which need not be a unit) to this type; returns the previous settings."""
    sd_cls, optim_cls = _CONFIGS[state_dict_type]
    state_dict_config = sd_cls() if state_dict_config is None else state_dict_config
    optim_state_dict_config = optim_cls() if optim_state_dict_config is None else optim_state_dict_config
    if type(state_dict_config) is not sd_cls:
        raise RuntimeError(f"Expected state_dict_config of type {sd_cls} but got {type(state_dict_config)}")
    if type(optim_state_dict_config) is not optim_cls:
        raise RuntimeError(f"Expected optim_state_dict_config of type {optim_cls} "
                           f"but got {type(optim_state_dict_config)}")
    inside = units(module)
    previous = settings_of(inside[0]) if inside else None
    new = StateDictSettings(state_dict_type, state_dict_config, optim_state_dict_config)
    for u in inside:
        u.__dict__["_state_dict_settings"] = new
    return previous if previous is not None else StateDictSettings(None, None, None)


def get_state_dict_type(module: nn.Module) -> StateDictSettings:
    """The settings of the units under ``module``; they must agree (as torch)."""
    inside = units(module)
    if not inside:
        raise ValueError("get_state_dict_type: no FSDP unit under this module")
    found = {settings_of(u).state_dict_type for u in inside}
    if len(found) > 1:
        raise AssertionError("All FSDP modules must have the same state_dict_type.")
    return settings_of(inside[0])


@contextlib.contextmanager
def state_dict_type(module: nn.Module, state_dict_type: StateDictType, state_dict_config=None,
                    optim_state_dict_config=None):
    """Inside, ``module.state_dict()`` / ``load_state_dict`` / ``FSDP.optim_state_dict`` use this type."""
    previous = set_state_dict_type(module, state_dict_type, state_dict_config, optim_state_dict_config)
    try:
        yield
    finally:
        for u in units(module):
            if previous.state_dict_type is None:
                u.__dict__.pop("_state_dict_settings", None)
            else:
                u.__dict__["_state_dict_settings"] = previous


def _mesh(unit) -> DeviceMesh:
    """A 1-D mesh over the unit's shard group (cached on the unit), for the SHARDED DTensors."""
    mesh = unit.__dict__.get("_state_dict_mesh")
    if mesh is None:
        device = unit.flat_param.device.type if unit.flat_param is not None else "cpu"
        mesh = unit.__dict__["_state_dict_mesh"] = DeviceMesh.from_group(unit.groups.shard, device)
    return mesh


def _chunked(full: torch.Tensor, mesh: DeviceMesh) -> DTensor:
    """This rank's ``torch.chunk(full, N)[r]`` along dim 0, as a DTensor (a 0-dim tensor is replicated)."""
    if full.dim() == 0:
        return DTensor.from_local(full, mesh, [Replicate()], run_check=False)
    r, n = mesh.get_local_rank(), mesh.size()
    chunks = torch.chunk(full, n)
    local = chunks[r].clone() if r < len(chunks) else full.new_empty((0, *full.shape[1:]))
    return DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=full.shape, stride=full.stride())


def _local_entries(root) -> list[tuple[str, nn.Module, str]]:
    """(key, module, attribute) of the LOCAL state dict in ``nn.Module.state_dict`` order: a unit's flat
    parameter (``_flat_param``) where it is registered, the parameters no unit manages (a module FSDP skips or
    ignores: kept whole, as torch's), then each module's persistent buffers."""
    out = []
    managed = flattened_params(root)

    def visit(m, prefix):
        if isinstance(m, Unit) and m._handle is not None:
            out.append((state_dict_name(prefix + "_flat_param"), m, "_flat_param"))
        for name, p in m._parameters.items():
            if p is not None and id(p) not in managed:
                out.append((state_dict_name(prefix + name), m, name))
        for name, b in m._buffers.items():
            if b is not None and name not in m._non_persistent_buffers_set:
                out.append((state_dict_name(prefix + name), m, name))
        for name, child in m._modules.items():
            if child is not None:
                visit(child, f"{prefix}{name}.")

    visit(root, "")
    return out


def _local_state_dict(root) -> "OrderedDict[str, torch.Tensor]":
    """Each unit's flat parameter as torch's ``ShardedTensor`` of the unpadded flat length, whose local shard is
    a view of this rank's shard without its end padding (torch's ``_local_post_state_dict_hook``): the padding
    is left out so that a load may use another number of ranks."""
    out: OrderedDict[str, torch.Tensor] = OrderedDict()
    for key, m, name in _local_entries(root):
        if name == "_flat_param":
            h = m._handle
            shard = h.flat_param.numel()
            valid = max(0, min(h.layout.numel - h.rank * shard, shard))
            # a shard's placement names the global rank (ShardedTensor checks it is in the group): under HYBRID_SHARD
            # the shard group of ranks 2 and 3 holds group ranks 0 and 1 (torch passes those and raises there)
            owner = torch.distributed.get_global_rank(h.groups.shard, h.rank)
            local = [LocalShard.from_tensor_and_offsets(h.flat_param.detach()[:valid], [shard * h.rank], owner)]
            out[key] = init_from_local_shards(local if valid > 0 else [], h.layout.numel,
                                              process_group=h.groups.shard)
        elif name in m._parameters:  # no unit manages it: the module's own tensor
            out[key] = m._parameters[name].detach()
        else:  # as the module holds it: in buffer_dtype once cast (torch casts back in FULL and SHARDED only)
            out[key] = m._buffers[name].detach().clone()
    return out


def _effective(unit) -> tuple[StateDictType, StateDictConfig]:
    """The unit's state-dict type and config; a NO_SHARD unit (FSDP on 1 rank too) gives and loads FULL with
    the default config whatever was set (torch FSDP1's ``_post_state_dict_hook``): a FULL type's
    ``rank0_only`` and ``offload_to_cpu`` too, so every rank gets the whole dict; with torch's warning where
    the type was not FULL (torch warns on every NO_SHARD state dict)."""
    settings = settings_of(unit)
    if getattr(unit, "sharding_strategy", None) is ShardingStrategy.NO_SHARD:
        if settings.state_dict_type is not StateDictType.FULL_STATE_DICT:
            warnings.warn("When using ``NO_SHARD`` for ``ShardingStrategy``, full_state_dict will be returned.",
                          stacklevel=3)
        return StateDictType.FULL_STATE_DICT, FullStateDictConfig()
    return settings.state_dict_type, settings.state_dict_config


def _lazy_init(unit) -> None:
    """torch's state-dict hooks begin with its ``_lazy_init``: before the first forward, this unit becomes the root
    then, and ``MixedPrecision.buffer_dtype`` casts the buffers then (FULL and SHARDED show them cast back)."""
    if unit._root is None:
        unit._lazy_init()


def typed_state_dict(unit) -> "OrderedDict[str, torch.Tensor]":
    """``unit.state_dict()`` under its state-dict type (a collective for FULL and SHARDED)."""
    _lazy_init(unit)
    kind, cfg = _effective(unit)
    if kind is StateDictType.FULL_STATE_DICT:
        sd = full_state_dict(unit, rank0_only=cfg.rank0_only)
    elif kind is StateDictType.SHARDED_STATE_DICT:  # gathered unit by unit, each parameter kept as its chunk
        mesh = _mesh(unit)
        sd = full_state_dict(unit, transform=lambda full: _chunked(full, mesh))
    else:
        sd = _local_state_dict(unit)
    if getattr(cfg, "offload_to_cpu", False):
        sd = OrderedDict((k, v.cpu()) for k, v in sd.items())
    return sd


def load_typed_state_dict(unit, state_dict, strict: bool = True):
    """``unit.load_state_dict(sd)`` under its state-dict type."""
    pitfalls.check_load_awaits_backward(unit)
    _lazy_init(unit)
    kind, _ = _effective(unit)
    if kind is StateDictType.SHARDED_STATE_DICT:
        state_dict = OrderedDict((k, v.full_tensor() if isinstance(v, DTensor) else v)
                                 for k, v in state_dict.items())
    elif kind is StateDictType.LOCAL_STATE_DICT:
        return _load_local(unit, state_dict, strict)
    return load_full_state_dict(unit, state_dict, strict=strict)


def _load_local(root, state_dict, strict: bool) -> _IncompatibleKeys:
    entries = _local_entries(root)
    keys = [k for k, _, _ in entries]
    missing = [k for k in keys if k not in state_dict]
    unexpected = [k for k in state_dict if k not in set(keys)]
    no_flat = next((i for i, (k, _, name) in enumerate(entries) if name == "_flat_param" and k in missing), None)
    if no_flat is not None:  # torch's pre-load hook asserts, strict or not, after the modules before it loaded
        _copy_local(entries[:no_flat], state_dict)
        raise AssertionError(f"No `FlatParameter` in `state_dict` for this FSDP instance but it has parameters "
                             f"(no key {entries[no_flat][0]}: a LOCAL state dict holds each unit's flat shard)")
    if strict and (missing or unexpected):
        raise RuntimeError(f"Error(s) in loading the LOCAL state_dict for {type(root).__name__}: "
                           f"missing keys {missing}, unexpected keys {unexpected}")
    _copy_local(entries, state_dict)
    return _IncompatibleKeys(missing, unexpected)


def _copy_local(entries, state_dict) -> None:
    """Copy each entry's value from ``state_dict`` (those it holds) into the model."""
    with torch.no_grad():
        for key, m, name in entries:
            if key not in state_dict:
                continue
            v = state_dict[key]
            if isinstance(v, ShardedTensor):  # this rank's piece (none where it holds only padding)
                shards = v.local_shards()
                v = shards[0].tensor if shards else torch.empty(0, dtype=v.dtype)
            if name == "_flat_param":  # the saved piece has no end padding
                m._handle.flat_param[: v.numel()].copy_(v.reshape(-1))  # (bumps its version: a kept full
                # buffer is seen stale, gathered again)
            elif name in m._parameters:
                m._parameters[name].copy_(v)
            else:
                m._buffers[name].copy_(v)


def load_under_a_plain_parent(unit, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs) -> None:
    """A load pre-hook: ``parent.load_state_dict(sd)`` where ``parent`` is a plain module and ``unit`` one of its
    FSDP children (torch's FSDP1 loads this way too).

    ``nn.Module.load_state_dict`` never calls a child's ``load_state_dict``; it walks the tree calling each
    module's ``_load_from_state_dict`` with its raw names (``0._fsdp_wrapped_module._flat_param``), which are not
    the names ``state_dict()`` gave (``0.weight``).  So the unit's keys are taken out and loaded here by
    :func:`load_typed_state_dict`, and the walk is handed the unit's own tensors under its raw names: copying a
    tensor onto itself changes nothing, and a nested unit finding its own tensors there knows it is loaded."""
    params = nn.Module.named_parameters(unit, prefix=prefix.rstrip("."), remove_duplicate=False)
    ours = dict((*params, *_persistent_buffers(unit, prefix)))
    keys = [k for k in state_dict if k.startswith(prefix)]
    if keys and all(state_dict[k] is ours.get(k) for k in keys):
        return  # an enclosing unit loaded this one
    sub = OrderedDict((k[len(prefix):], state_dict.pop(k)) for k in keys)
    result = load_typed_state_dict(unit, sub, strict=False)
    missing_keys.extend(prefix + k for k in result.missing_keys)
    unexpected_keys.extend(prefix + k for k in result.unexpected_keys)
    state_dict.update(ours)


def _persistent_buffers(unit: nn.Module, prefix: str):
    for path, m in nn.Module.named_modules(unit, prefix=prefix.rstrip("."), remove_duplicate=False):
        for name, b in m._buffers.items():
            if b is not None and name not in m._non_persistent_buffers_set:
                yield (f"{path}.{name}" if path else name), b
