"""``minifsdp.FullyShardedDataParallel``: the core's FSDP with the rest of torch FSDP1's API.

The algorithm is ``minifsdp/fsdp/core/`` (read ``core/fsdp.py`` first); this class extends it,
so that code written for torch's FSDP1 runs unchanged on ours:

    keyword / method                          where it is handled
    use_orig_params=True                      orig_params.py (a handle subclass chosen at wrap time)
    cpu_offload, ignored_modules, ignored_states, device_mesh, torch's enums and MixedPrecision
                                              torch_options.py
    param_init_fn, a meta-device model, sync_module_states
                                              deferred_init.py
    model.half() / .to(dtype) after wrapping  dtype_change.py, torch_handle.py
    state_dict_type, SHARDED / LOCAL state dicts, optim_state_dict
                                              state_dict_type.py, optim_state.py
    summon_full_params(with_grads=, offload_to_cpu=), apply, fsdp_modules, model[i], attributes of
    the wrapped module                        here
    bad input at wrap time and step time      checks.py (weights that differ across ranks, several
                                              devices, a stale optimizer, a weight tied across units,
                                              an optimizer step between a forward and its backward)
    a frozen unit's reshard, the free before the concat
                                              backward_extras.py

Positional order is torch's.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten

from minifsdp.fsdp import deferred_init, optim_state
from minifsdp.fsdp import state_dict_type as sd_type
from minifsdp.fsdp import torch_options as opts
from minifsdp.fsdp.backward_extras import register_free_before_concat, register_reshard_only_hook
from minifsdp.fsdp.checks import (
    check_layer_cls_matches,
    check_one_device,
    check_same_on_all_ranks,
    check_ties_across_units,
    install_optimizer_check,
)
from minifsdp.fsdp.core import fsdp as core
from minifsdp.fsdp.core.full_params import summon_full_params as summon_core
from minifsdp.fsdp.core.mixed_precision import MixedPrecision, resolve_dtypes
from minifsdp.fsdp.core.prefetch import BackwardPrefetch
from minifsdp.fsdp.core.state import TrainingState
from minifsdp.fsdp.core.strategy import ShardingStrategy
from minifsdp.fsdp.core.units import clean_name, flattened_params, is_unit, units, units_with_params
from minifsdp.fsdp.core.wrap import recursive_wrap
from minifsdp.fsdp.dtype_change import flat_param_registered
from minifsdp.fsdp.orig_params import OrigParamHandle
from minifsdp.fsdp.torch_handle import TorchHandle

__all__ = ["FullyShardedDataParallel", "FSDP", "ShardingStrategy", "BackwardPrefetch", "MixedPrecision",
           "summon_full_params"]


@contextlib.contextmanager
def summon_full_params(module: nn.Module, recurse: bool = True, writeback: bool = True, rank0_only: bool = False,
                       offload_to_cpu: bool = False, with_grads: bool = False):
    """The core's ``summon_full_params`` with torch's two other options.

    ``with_grads=True`` (``use_orig_params=True`` only, as torch): each parameter's ``.grad`` is the
    full gradient too (all-gathered; zeros where a rank had none); the shards' gradients come back
    on exit, updated from the full ones with ``writeback`` (an edit inside is kept, as torch).
    ``offload_to_cpu``: the full parameters are on the CPU already when the model is.
    """
    inside = units_with_params(module) if recurse else [module] if is_unit(module) and module._handle else []
    if with_grads and (offload_to_cpu or any(not u._handle.use_orig_params for u in units_with_params(module))):
        raise NotImplementedError("summon_full_params(with_grads=True) needs use_orig_params=True and "
                                  "offload_to_cpu=False (as in torch)")
    if offload_to_cpu and any(u._handle.flat_param.device.type != "cpu" for u in units_with_params(module)):
        raise NotImplementedError("summon_full_params(offload_to_cpu=True) on an accelerator is not implemented "
                                  "in minifsdp: pass offload_to_cpu=False")
    grads = []
    try:
        with summon_core(module, recurse, writeback, rank0_only):
            grads = [u._handle.show_full_grads() for u in inside] if with_grads else []
            try:
                yield
            finally:
                for u in inside if with_grads else []:  # the full gradients go first: .data and .grad must agree
                    for slot in u._handle.layout.slots if u._handle.sharded else []:  # (NO_SHARD's stay)
                        slot.param.grad = None
    finally:
        for u, before in zip(inside, grads):
            u._handle.restore_grads(before, writeback)


class FullyShardedDataParallel(core.FullyShardedDataParallel):
    """torch FSDP1's ``FullyShardedDataParallel``: the core's arguments (``core/fsdp.py``), and torch's others.

    Args (beyond the core's):
        cpu_offload, ignored_modules, ignored_states: torch's, read as ``torch_options.py`` says.
        param_init_fn: for a model built on the meta device, called on each module of a unit before it
            is flattened (without it: ``to_empty`` + ``reset_parameters()``): ``deferred_init.py``.
        device_id: move the module there first (``torch.device("cpu")``, or a CUDA index).
        sync_module_states: copy rank 0's parameters and buffers to every rank at wrap time, unit by unit
            (on CPU too: torch FSDP1's needs a GPU).
        use_orig_params: show the original parameters (views of the local shard): ``orig_params.py``.
        device_mesh: a 1-D mesh, or 2-D (replicate, shard) for HYBRID_SHARD.
    """

    def __init__(self, module: nn.Module, process_group=None, sharding_strategy=ShardingStrategy.FULL_SHARD,
                 cpu_offload=None, auto_wrap_policy=None,
                 backward_prefetch: BackwardPrefetch | None = BackwardPrefetch.BACKWARD_PRE,
                 mixed_precision: MixedPrecision | None = None, ignored_modules=None, param_init_fn=None,
                 device_id=None, sync_module_states: bool = False, forward_prefetch: bool = False,
                 limit_all_gathers: bool = True, use_orig_params: bool = False, ignored_states=None,
                 device_mesh=None, collectives: str = "torch"):
        if not isinstance(module, nn.Module):
            raise TypeError(f"FSDP wraps an nn.Module, got {type(module).__name__}")
        sharding_strategy = opts.normalize_strategy(sharding_strategy)
        backward_prefetch = opts.normalize_prefetch(backward_prefetch)
        mixed_precision = opts.normalize_mixed_precision(mixed_precision)
        opts.check_cpu_offload(cpu_offload)
        ignored_mods, ignored = opts.ignored_params(module, ignored_modules, ignored_states)
        if mixed_precision is not None and not isinstance(mixed_precision, MixedPrecision):
            raise TypeError("mixed_precision takes a MixedPrecision(param_dtype=..., reduce_dtype=...), "
                            f"got {type(mixed_precision).__name__} (there is no mixed_precision=True)")
        if backward_prefetch is not None and not isinstance(backward_prefetch, BackwardPrefetch):
            raise TypeError("backward_prefetch takes BackwardPrefetch.BACKWARD_PRE, BackwardPrefetch.BACKWARD_POST "
                            f"or None, got {backward_prefetch!r}")
        # Set before the core's __init__, which calls _auto_wrap and _make_handle below.
        self.__dict__.update(
            use_orig_params=use_orig_params, cpu_offload=cpu_offload, _ignored_modules=ignored_mods,
            _ignored_params=ignored, _param_init_fn=param_init_fn, _device_id=device_id,
            _sync_module_states=sync_module_states,
            _torch_kwargs=dict(process_group=process_group, cpu_offload=cpu_offload, use_orig_params=use_orig_params,
                               device_id=device_id, ignored_states=ignored or None, device_mesh=device_mesh,
                               sync_module_states=sync_module_states, param_init_fn=param_init_fn))
        fp32 = ()
        if auto_wrap_policy is not None:
            check_layer_cls_matches(module, auto_wrap_policy)
            fp32 = tuple(mixed_precision._module_classes_to_ignore) if mixed_precision is not None else ()
            if fp32:  # as torch: those modules become their own units, without mixed precision
                auto_wrap_policy = opts.policy_with_mp_overrides(auto_wrap_policy, fp32)
                opts.override_mixed_precision(module, fp32)
        self.__dict__["_fp32_classes"] = fp32
        super().__init__(module, opts.mesh_process_group(sharding_strategy, process_group, device_mesh),
                         sharding_strategy, auto_wrap_policy, backward_prefetch, mixed_precision, forward_prefetch,
                         limit_all_gathers, collectives)
        self._reshard_only_hook = None  # a frozen unit's post-backward, on its inputs (backward_extras.py)
        self._free_token = None  # the free-before-concat hook of this iteration (backward_extras.py)
        self._versions_at_forward = None  # the root's: shard versions at a forward that awaits its backward
        self.register_load_state_dict_pre_hook(sd_type.load_under_a_plain_parent)  # a plain root above us
        install_optimizer_check()

    def _auto_wrap(self, module: nn.Module, policy, kwargs: dict) -> None:
        kwargs = {**kwargs, **self._torch_kwargs}
        fp32, mp = self._fp32_classes, kwargs.pop("mixed_precision")
        recursive_wrap(module, policy, lambda m: type(self)(m, mixed_precision=None if isinstance(m, fp32) else mp,
                                                            **kwargs),
                       only_wrap_children=True, ignored=self._ignored_modules)

    def _make_handle(self, module: nn.Module):
        deferred_init.materialize(module, self._param_init_fn, self._device_id, self._ignored_modules,
                                  self._ignored_params)  # a meta-device model
        device_id = self._device_id
        if device_id is not None:
            module.to(torch.device(device_id) if not isinstance(device_id, int) else torch.device("cuda", device_id))
        check_ties_across_units(module, self.use_orig_params)
        taken = flattened_params(module)
        params = [p for p in module.parameters() if id(p) not in taken and p not in self._ignored_params]
        ignored_buffers = {id(b) for m in self._ignored_modules for b in m.buffers()}
        nested = {id(b) for m in units(module) for b in m.buffers()}
        buffers = [b for b in module.buffers() if id(b) not in nested and id(b) not in ignored_buffers]
        check_one_device(module, params, buffers)
        if self._sync_module_states:
            deferred_init.sync_module_states(self.groups, module, params, buffers)  # shapes checked first
        else:
            check_same_on_all_ranks(self.groups, module, params, buffers)
        if not params:
            return None
        core.check_flattenable(module, params, mixed_requires_grad=self.use_orig_params)
        if not self.use_orig_params:
            return TorchHandle(module, params, self.groups, self.sharding_strategy, self.comm, self.mixed_precision)
        align = 16 // resolve_dtypes(self.mixed_precision, params[0].dtype).param.itemsize  # torch's 16 bytes
        return OrigParamHandle(module, params, self.groups, self.sharding_strategy, self.comm, self.mixed_precision,
                               align_numel=align)

    # ------------------------------------------------------------------ torch's module API
    @property
    def _flat_param(self) -> nn.Parameter | None:
        """torch's name for :attr:`flat_param` (code written for torch reads ``unit._flat_param``)."""
        return self.flat_param

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:  # attributes of the wrapped module, as torch forwards them
            inner = self._modules.get("_fsdp_wrapped_module")
            if inner is None:
                raise
            return getattr(inner, name)

    def __getitem__(self, key):
        """``model[0]`` on a wrapped ``nn.Sequential`` / ``ModuleList``, as torch (forwarded)."""
        return self._fsdp_wrapped_module[key]

    @staticmethod
    def fsdp_modules(module: nn.Module, root_only: bool = False) -> list:
        """Every FSDP unit in ``module`` (itself included), in ``modules()`` order; the outermost only if
        ``root_only``."""
        found = units(module)
        if root_only:
            return [u for u in found if not any(o is not u and u in list(o.modules()) for o in found)]
        return found

    def apply(self, fn):
        """``nn.Module.apply``; before the first forward, inside ``summon_full_params`` (as torch), so an
        initializer sees and writes the full parameters."""
        with summon_core(self, recurse=False) if self._root is None else contextlib.nullcontext():
            return super().apply(fn)

    summon_full_params = staticmethod(summon_full_params)

    def named_parameters(self, *args, **kwargs):
        """As ``nn.Module``'s; inside ``summon_full_params`` with the plain model's names (as torch)."""
        clean = self.training_state is TrainingState.SUMMON_FULL_PARAMS
        for name, p in super().named_parameters(*args, **kwargs):
            yield (clean_name(name) if clean else name), p

    def named_buffers(self, *args, **kwargs):
        """As ``nn.Module``'s; inside ``summon_full_params`` with the plain model's names (as torch)."""
        clean = self.training_state is TrainingState.SUMMON_FULL_PARAMS
        for name, b in super().named_buffers(*args, **kwargs):
            yield (clean_name(name) if clean else name), b

    def _apply(self, fn, *args, **kwargs):
        """``model.half()``, ``.to(dtype)``, ``.double()``: convert the flat parameters (``dtype_change.py``)."""
        h = self.__dict__.get("_handle")
        if h is None or not h.use_orig_params:
            return super()._apply(fn, *args, **kwargs)
        with flat_param_registered(h, self._fsdp_wrapped_module):
            return super()._apply(fn, *args, **kwargs)

    def state_dict(self, *args, destination=None, prefix: str = "", keep_vars: bool = False):
        """The state dict of the type set by ``FSDP.state_dict_type`` (torch's default: FULL, every rank)."""
        sd = sd_type.typed_state_dict(self)
        if destination is None and not prefix:
            return sd
        out = type(sd)() if destination is None else destination  # every key under ``prefix``, as torch
        out.update((prefix + k, v) for k, v in sd.items())
        return out

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Load a state dict of the type set by ``FSDP.state_dict_type``; each rank keeps its shard."""
        return sd_type.load_typed_state_dict(self, state_dict, strict=strict)

    state_dict_type = staticmethod(sd_type.state_dict_type)
    set_state_dict_type = staticmethod(sd_type.set_state_dict_type)
    get_state_dict_type = staticmethod(sd_type.get_state_dict_type)
    optim_state_dict = staticmethod(optim_state.optim_state_dict)
    optim_state_dict_to_load = staticmethod(optim_state.optim_state_dict_to_load)

    # ------------------------------------------------------------------ the step, with torch's extras
    def _init_root(self) -> None:
        super()._init_root()
        opts.check_homogeneous(self._root_step.units)
        for unit in self._root_step.units:  # torch's lazy init: the dtypes are fixed from now on
            if unit._handle is not None:
                unit._handle.fix_dtype()

    def _root_pre_forward(self) -> None:
        step = self._root_step
        for unit in step.units:  # requires_grad set by the user after wrapping
            if unit._handle is not None:
                unit._handle.refresh_requires_grad()
        if self._versions_at_forward is not None and torch.is_grad_enabled() \
                and self._versions_at_forward != _shard_versions(step.units):
            raise RuntimeError(
                "FSDP: forward called again before the backward of the previous forward, and the sharded "
                "parameters changed in between (an optimizer step?). That backward would see the new "
                "parameters. Call backward on the previous output before stepping, or run forwards you "
                "do not differentiate under torch.no_grad().")
        super()._root_pre_forward()

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        if self.is_root and torch.is_grad_enabled() and any(
                isinstance(t, torch.Tensor) and t.requires_grad for t in tree_flatten(out)[0]):
            self._versions_at_forward = _shard_versions(self._root_step.units)
        return out

    def _pre_forward(self, args, kwargs):
        again = self.training_state is TrainingState.AWAITING_BACKWARD
        args, kwargs = super()._pre_forward(args, kwargs)
        h = self._handle
        if h is not None and not h.unsharded.requires_grad:
            register_reshard_only_hook(self, args, kwargs)
        register_free_before_concat(self, again)
        return args, kwargs

    def _finish_backward(self) -> None:
        if self._reshard_only_hook is not None:
            self._reshard_only_hook.remove()
            self._reshard_only_hook = None
        self._versions_at_forward = None
        super()._finish_backward()


FSDP = FullyShardedDataParallel


def _shard_versions(inside: list) -> list[tuple[int, ...]]:
    return [u._handle.shard_version() for u in inside if u._handle is not None]
