"""``minifsdp.FullyShardedDataParallel``: the core's FSDP with the rest of torch FSDP1's API.

The algorithm is ``minifsdp/fsdp/core/`` (its ``__init__.py`` gives the reading order).  This class
is the core's class, built with a list of extensions (``core/extension.py``: the one interface,
called at fixed points of the step) and torch's constructor keywords and methods, so that code
written for torch's FSDP1 runs unchanged on ours.  It overrides no step of the core.

    keyword / method                          where it is handled
    use_orig_params=True                      orig_params.py: the OrigParams extension
    cpu_offload, ignored_modules, ignored_states, device_mesh, torch's enums and MixedPrecision,
    MixedPrecision._module_classes_to_ignore  torch_options.py (here, before the core wraps);
                                              torch_extension.py (ignored parameters at on_wrap)
    param_init_fn, a meta-device model, sync_module_states
                                              deferred_init.py (here, before the core wraps; the sync
                                              at on_wrap)
    model.half() / .to(dtype) after wrapping  dtype_change.py, torch_extension.py (before_unshard)
    requires_grad changed after wrapping      torch_extension.py (before_forward)
    state_dict_type, SHARDED / LOCAL state dicts, optim_state_dict
                                              state_dict_type.py, optim_state.py
    summon_full_params(with_grads=, offload_to_cpu=), apply, fsdp_modules, model[i], attributes of
    the wrapped module                        here
    bad input at wrap time and step time      checks.py, through torch_extension.py (weights that differ
                                              across ranks, several devices, a stale optimizer, a weight
                                              tied across units, an optimizer step between a forward and
                                              its backward)
    a frozen unit's reshard, the free before the concat
                                              backward_extras.py: the BackwardExtras extension

Each unit gets its own extensions, in this order, at these points of the step (``core/extension.py``):

    extension        point            what it adds
    TorchExtension   on_wrap          ignored parameters kept out; the wrap-time checks; a unit mixing frozen
                                      and trainable parameters refused (without use_orig_params); the marks
                     on_lazy_init     every unit agrees on use_orig_params / limit_all_gathers; dtypes fixed
                     before_forward   (root) requires_grad changed after wrapping; a step between a forward
                                      and its backward refused
                     before_unshard   model.half() before the first forward followed, after it refused
                     after_forward, after_backward   (root) the shards' versions at a forward, then forgotten
    BackwardExtras   before_forward   a frozen unit's reshard-only hook; after_backward removes it
                     after_unshard    the free before the gradients' concat
    CalledOutsideItsUnit after_reshard  (once, at wrap) each module holding a parameter refuses a call while
                                      its unit is idle (a wrapped container iterated, not called)
    OrigParams       on_wrap          the 16-byte alignment; the originals kept
    (use_orig_params before_unshard   the write-back of what the user changed
     =True)          after_unshard    views registered in the forward, plain in the pre-backward, the originals
                                      themselves in summon_full_params; a zero_grad() on the originals
                     after_reshard    the originals as views of the shard (SHARD_GRAD_OP: the forward's views kept)
                     after_reduce     each original's .grad, a view of the shard's; optimizers in backward
                     after_backward   a unit that kept the forward's views, never reached by the backward: freed

Before the core wraps (in ``__init__``, no extension needed): auto-wrapping around ignored modules and
``MixedPrecision._module_classes_to_ignore`` (``torch_options.py``), a meta-device model, ``device_id``.
Positional order is torch's.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn

from minifsdp.fsdp import deferred_init, optim_state, pitfalls
from minifsdp.fsdp import state_dict_type as sd_type
from minifsdp.fsdp import torch_options as opts
from minifsdp.fsdp.backward_extras import BackwardExtras
from minifsdp.fsdp.called_outside import CalledOutsideItsUnit
from minifsdp.fsdp.checks import check_layer_cls_matches, install_optimizer_check
from minifsdp.fsdp.core import fsdp as core
from minifsdp.fsdp.core.fsdp import TrainingState
from minifsdp.fsdp.core.prefetch import BackwardPrefetch
from minifsdp.fsdp.core.strategy import ShardingStrategy
from minifsdp.fsdp.core.units import clean_name, is_unit, units, units_with_params
from minifsdp.fsdp.dtype_change import flat_param_registered
from minifsdp.fsdp.full_params import clip_grad_norm_ as clip_core
from minifsdp.fsdp.full_params import summon_full_params as summon_core
from minifsdp.fsdp.orig_params import OrigParams, drop_full_grads, restore_grads, show_full_grads
from minifsdp.fsdp.torch_extension import TorchExtension
from minifsdp.fsdp.torch_options import MixedPrecision

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
    if with_grads and (offload_to_cpu or any(not getattr(u, "use_orig_params", False)
                                             for u in units_with_params(module))):
        raise NotImplementedError("summon_full_params(with_grads=True) needs use_orig_params=True and "
                                  "offload_to_cpu=False (as in torch)")
    if offload_to_cpu and any(u._handle.flat_param.device.type != "cpu" for u in units_with_params(module)):
        raise NotImplementedError("summon_full_params(offload_to_cpu=True) on an accelerator is not implemented "
                                  "in minifsdp: pass offload_to_cpu=False")
    saved = {}
    with contextlib.ExitStack() as stack:  # unit by unit, as torch: its parameters, then its gradients
        for u in units(module) if recurse else [module] if is_unit(module) else []:
            h = u._handle if with_grads else None
            if h is not None:  # exits last: the shards' gradients back once .data is the shard again
                stack.callback(lambda h=h: restore_grads(h, saved.get(h), writeback))
            stack.enter_context(summon_core(u, False, writeback, rank0_only))
            if h is not None:
                saved[h] = show_full_grads(h)
                stack.callback(drop_full_grads, h)  # exits first: .data and .grad must agree
        yield


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
        device_mesh: a 1-D mesh, or 2-D (replicate, shard) for HYBRID_SHARD.  HYBRID_SHARD with neither this
            nor ``process_group`` (and an ``auto_wrap_policy``): torch's groups, one shard group per node
            (``torch_options.node_groups``).
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
        ignored_mods, ignored = opts.ignored_params(module, ignored_modules, ignored_states)
        if mixed_precision is not None and not isinstance(mixed_precision, MixedPrecision):
            raise TypeError("mixed_precision takes a MixedPrecision(param_dtype=..., reduce_dtype=...), "
                            f"got {type(mixed_precision).__name__} (there is no mixed_precision=True)")
        if backward_prefetch is not None and not isinstance(backward_prefetch, BackwardPrefetch):
            raise TypeError("backward_prefetch takes BackwardPrefetch.BACKWARD_PRE, BackwardPrefetch.BACKWARD_POST "
                            f"or None, got {backward_prefetch!r}")
        # the groups, once for the root and the units below it: a mesh's, or HYBRID's built as torch's
        process_group = opts.mesh_process_group(sharding_strategy, process_group, device_mesh, auto_wrap_policy,
                                                lambda: opts.devices_per_node(module, device_id))
        if auto_wrap_policy is not None:  # children first, each a unit of this class (post-order, as torch)
            check_layer_cls_matches(module, auto_wrap_policy)
            fp32 = tuple(mixed_precision._module_classes_to_ignore) if mixed_precision is not None else ()
            if fp32:  # as torch: those modules become their own units, without mixed precision
                auto_wrap_policy = opts.policy_with_mp_overrides(auto_wrap_policy, fp32)
                opts.override_mixed_precision(module, fp32)
            child = dict(process_group=process_group, sharding_strategy=sharding_strategy,
                         cpu_offload=cpu_offload,  # offload_params=True: refused at the first forward
                         backward_prefetch=backward_prefetch, param_init_fn=param_init_fn, device_id=device_id,
                         sync_module_states=sync_module_states, forward_prefetch=forward_prefetch,
                         limit_all_gathers=limit_all_gathers, use_orig_params=use_orig_params,
                         ignored_states=ignored or None, collectives=collectives)
            opts.wrap_children(module, auto_wrap_policy, lambda m: type(self)(
                m, mixed_precision=None if isinstance(m, fp32) else mixed_precision, **child), ignored_mods)
        deferred_init.materialize(module, param_init_fn, device_id, ignored_mods, ignored)  # a meta-device model
        if device_id is not None:
            module.to(torch.device(device_id) if not isinstance(device_id, int) else torch.device("cuda", device_id))
        extensions = [TorchExtension(ignored_mods, ignored, sync_module_states, use_orig_params),
                      BackwardExtras(free_before_concat=not use_orig_params), CalledOutsideItsUnit()]
        if use_orig_params:
            extensions.append(OrigParams())
        super().__init__(module, process_group, sharding_strategy, None, backward_prefetch, mixed_precision,
                         forward_prefetch, limit_all_gathers, collectives, extensions)
        self.use_orig_params, self.cpu_offload = use_orig_params, cpu_offload
        self.register_load_state_dict_pre_hook(sd_type.load_under_a_plain_parent)  # a plain root above us
        install_optimizer_check()
        pitfalls.warn_hybrid_shard_of_one(self)  # ch 6: torch turns it into NO_SHARD silently (pitfalls.py)

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

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the global gradient norm over all shards (collective); returns the total norm, as torch
        (``full_params.py`` says how: local squares, one all-reduce)."""
        return clip_core(self, max_norm, norm_type)

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
        orig = next((e for e in self.__dict__.get("_extensions", ()) if isinstance(e, OrigParams)), None)
        if self.__dict__.get("_handle") is None or orig is None:
            return super()._apply(fn, *args, **kwargs)
        with flat_param_registered(self, orig):
            return super()._apply(fn, *args, **kwargs)

    def state_dict(self, *args, destination=None, prefix: str = "", keep_vars: bool = False):
        """The state dict of the type set by ``FSDP.state_dict_type`` (torch's default: FULL, every rank)."""
        pitfalls.check_not_torch_dcp()
        sd = sd_type.typed_state_dict(self)
        if destination is None and not prefix:
            return sd
        out = type(sd)() if destination is None else destination  # every key under ``prefix``, as torch
        out.update((prefix + k, v) for k, v in sd.items())
        return out

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Load a state dict of the type set by ``FSDP.state_dict_type``; each rank keeps its shard."""
        pitfalls.check_not_torch_dcp()
        return sd_type.load_typed_state_dict(self, state_dict, strict=strict)

    state_dict_type = staticmethod(sd_type.state_dict_type)
    set_state_dict_type = staticmethod(sd_type.set_state_dict_type)
    get_state_dict_type = staticmethod(sd_type.get_state_dict_type)
    optim_state_dict = staticmethod(optim_state.optim_state_dict)
    optim_state_dict_to_load = staticmethod(optim_state.optim_state_dict_to_load)


FSDP = FullyShardedDataParallel

