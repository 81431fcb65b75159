"""FullyShardedDataParallel (chapter 2): a module whose parameters live sharded across ranks.

    model = FSDP(TinyGPT(), auto_wrap_policy=partial(transformer_auto_wrap_policy, transformer_layer_cls={Block}))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)   # AFTER wrapping: it steps the local shards
    loss = model(x, y); loss.backward(); model.clip_grad_norm_(1.0); opt.step(); opt.zero_grad()

Each wrapped module is a *unit* with one flat parameter (``flat_param.py``).  A
step, for a root with two nested units, FULL_SHARD (AG = all-gather, RS =
reduce-scatter):

    forward:   AG root | AG b0, run b0, free b0 | AG b1, run b1, free b1 | run root tail
    backward:           AG b1, grad b1, RS b1, free | AG b0, grad b0, wait RS b1, RS b0, free | grad root, ...
    end:       final callback at the root: wait for the last RS, grads land in each unit's flat_param.grad

Collectives are asynchronous: on a GPU a reduce-scatter runs while the next unit computes
(one in flight: each post-backward finishes the previous unit's; on CPU its own, as torch),
and with prefetching (``prefetch.py``) so does the next unit's all-gather.

Two objects per unit, each with one job, and calls go one way (unit -> handle):

    FullyShardedDataParallel (this module)   hooks, order, TrainingState: decides *when*
    FlatParamHandle (``handle.py``)           tensors and collectives, HandleState: does *what*

The forward is here; the backward's hooks (pre-backward, post-backward, a frozen
unit's reshard-only hook, the final callback) are ``backward.py``.

Mixed precision: ``mixed_precision.py``; activation checkpointing:
``activation_checkpointing.py``; summon, clipping and state dicts:
``full_params.py``; a timeline of it all: ``minifsdp/tools/tracing.py``.

Note (root): the outermost unit whose forward runs first is the root
(``root.py``).  It keeps the ``RootStep`` (its units, their order, the final
callback), checks the step's order (one forward per backward unless the shards
are unchanged) and owns ``clip_grad_norm_``.

Note (the optimizer): ``model.parameters()`` after wrapping yields each unit's
``flat_param`` (the local 1-D shard; with ``use_orig_params=True``, the
original parameters as views into it).  An optimizer built *before* wrapping
holds the old tensors, which no longer train: its first ``step()`` raises.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
import weakref

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils._pytree import tree_flatten

from minifsdp.fsdp import deferred_init, full_params, optim_state
from minifsdp.fsdp import state_dict_type as sd_type
from minifsdp.fsdp import torch_options as opts
from minifsdp.fsdp.backward import post_backward, pre_backward, register_free_before_concat, register_reshard_only_hook
from minifsdp.fsdp.checks import check_one_device, check_same_on_all_ranks, install_optimizer_check
from minifsdp.fsdp.dtype_change import adopt_dtype, flat_param_registered
from minifsdp.fsdp.events import span
from minifsdp.fsdp.handle import FlatParamHandle
from minifsdp.fsdp.mixed_precision import MixedPrecision, cast_floating
from minifsdp.fsdp.prefetch import BackwardPrefetch, prefetch
from minifsdp.fsdp.root import RootStep, check_versions, init_root, shard_versions
from minifsdp.fsdp.sharding import RESHARD_AFTER_FORWARD, Comm, ShardingStrategy, resolve_groups
from minifsdp.fsdp.state import TrainingState
from minifsdp.fsdp.units import Unit, clean_name, units
from minifsdp.fsdp.wrap import check_ties_across_units, recursive_wrap

__all__ = ["FullyShardedDataParallel", "FSDP", "ShardingStrategy", "BackwardPrefetch", "MixedPrecision"]


class FullyShardedDataParallel(Unit):
    """Shard ``module``'s parameters over ``process_group``; arguments named and meant as torch's.

    Args:
        module: the module to shard (all parameters and buffers on one device).
        process_group: the ranks to shard over (default: all); for HYBRID_SHARD a
            tuple ``(shard_group, replicate_group)``.
        sharding_strategy: a :class:`ShardingStrategy`.
        auto_wrap_policy: e.g. ``partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})``.
        use_orig_params: show the original parameters (views of the local shard) instead of flat ones.
        device_id: move the module there first (``torch.device("cpu")``, or a CUDA index).
        sync_module_states: copy rank 0's parameters and buffers to every rank at wrap time, unit by unit
            (on CPU too: torch FSDP1's needs a GPU).
        device_mesh: a 1-D mesh, or 2-D (replicate, shard) for HYBRID_SHARD.
        collectives: ``"torch"`` (torch.distributed's) or ``"ring"`` (ours, ``minifsdp.comm.collectives``).
        mixed_precision: a :class:`~minifsdp.fsdp.mixed_precision.MixedPrecision` (fp32 master shards,
            compute in ``param_dtype``, reduce in ``reduce_dtype``), as torch FSDP1's.
        backward_prefetch: ``BackwardPrefetch.BACKWARD_PRE`` (torch's default), ``BACKWARD_POST`` or None
            (``prefetch.py``); forward_prefetch: prefetch in the forward too, in the first iteration's order;
        limit_all_gathers: a prefetch waits while two non-root units' full parameters are alive or
            in flight (an all-gather a unit needs right now is never refused).
        cpu_offload, ignored_modules, ignored_states: torch's, read as ``torch_options.py`` says
            (torch's ``ShardingStrategy`` / ``BackwardPrefetch`` / ``MixedPrecision`` are taken too).
        param_init_fn: for a model built on the meta device, called on each module of a unit before it is
            flattened (without it: ``to_empty`` + ``reset_parameters()``), as torch: ``deferred_init.py``.

    Positional order is torch's.  The torch-API surface beyond the core (state-dict types,
    traversal, ``apply``, indexing) maps onto it in ``state_dict_type.py``, ``optim_state.py``
    and the methods below.
    """

    def __init__(self, module: nn.Module, process_group=None, sharding_strategy=ShardingStrategy.FULL_SHARD,
                 cpu_offload=None, auto_wrap_policy=None,
                 backward_prefetch: BackwardPrefetch | None = BackwardPrefetch.BACKWARD_PRE,
                 mixed_precision: MixedPrecision | None = None, ignored_modules=None, param_init_fn=None,
                 device_id=None, sync_module_states: bool = False, forward_prefetch: bool = False,
                 limit_all_gathers: bool = True, use_orig_params: bool = False, ignored_states=None,
                 device_mesh=None, collectives: str = "torch"):
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"FSDP wraps an nn.Module, got {type(module).__name__}")
        if not dist.is_initialized():
            raise RuntimeError("FSDP needs a process group: call dist.init_process_group first "
                               "(or run your function with minifsdp.spawn).")
        sharding_strategy = opts.normalize_strategy(sharding_strategy)  # torch_options.py: torch's keywords
        backward_prefetch = opts.normalize_prefetch(backward_prefetch)
        mixed_precision = opts.normalize_mixed_precision(mixed_precision)
        opts.check_cpu_offload(cpu_offload)
        ignored_mods, ignored = opts.ignored_params(module, ignored_modules, ignored_states)
        self.groups = resolve_groups(sharding_strategy, process_group, device_mesh)
        if sharding_strategy in (ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP) \
                and self.groups.shard_size == 1:
            warnings.warn("FSDP on 1 rank: nothing to shard, using NO_SHARD (as torch does)", stacklevel=2)
            sharding_strategy = ShardingStrategy.NO_SHARD
        self.sharding_strategy = sharding_strategy
        self.use_orig_params = use_orig_params
        self.cpu_offload = cpu_offload
        self.comm = Comm(collectives)
        if mixed_precision is not None and not isinstance(mixed_precision, MixedPrecision):
            raise TypeError("mixed_precision takes a MixedPrecision(param_dtype=..., reduce_dtype=...), "
                            f"got {type(mixed_precision).__name__} (there is no mixed_precision=True)")
        self.mixed_precision = mixed_precision
        if backward_prefetch is not None and not isinstance(backward_prefetch, BackwardPrefetch):
            raise TypeError("backward_prefetch takes BackwardPrefetch.BACKWARD_PRE, BackwardPrefetch.BACKWARD_POST "
                            f"or None, got {backward_prefetch!r}")
        self.backward_prefetch, self.forward_prefetch = backward_prefetch, forward_prefetch
        self.limit_all_gathers = limit_all_gathers
        if auto_wrap_policy is not None:
            kwargs = dict(process_group=process_group, sharding_strategy=sharding_strategy, cpu_offload=cpu_offload,
                          use_orig_params=use_orig_params, device_id=device_id, ignored_states=ignored or None,
                          sync_module_states=sync_module_states, device_mesh=device_mesh, collectives=collectives,
                          backward_prefetch=backward_prefetch, forward_prefetch=forward_prefetch,
                          limit_all_gathers=limit_all_gathers, param_init_fn=param_init_fn)
            fp32 = tuple(mixed_precision._module_classes_to_ignore) if mixed_precision is not None else ()
            if fp32:  # as torch: those modules become their own units, without mixed precision
                auto_wrap_policy = opts.policy_with_mp_overrides(auto_wrap_policy, fp32)
                opts.override_mixed_precision(module, fp32)
            recursive_wrap(module, auto_wrap_policy, lambda m: FullyShardedDataParallel(
                m, mixed_precision=None if isinstance(m, fp32) else mixed_precision, **kwargs),
                only_wrap_children=True, ignored=ignored_mods)
        deferred_init.materialize(module, param_init_fn, device_id, ignored_mods, ignored)  # a meta-device model
        if device_id is not None:
            module.to(torch.device(device_id) if not isinstance(device_id, int) else torch.device("cuda", device_id))
        self._fsdp_wrapped_module = module
        check_ties_across_units(module, use_orig_params)  # wrap.py: a weight tied across units
        params = [p for p in module.parameters() if not _is_managed(p) and p not in ignored]
        ignored_buffers = {id(b) for m in ignored_mods for b in m.buffers()}
        buffers = [b for b in _own_buffers(module) if id(b) not in ignored_buffers]
        check_one_device(module, params, buffers)
        if sync_module_states:
            deferred_init.sync_module_states(self.groups, module, params, buffers)  # shapes checked first
        else:
            check_same_on_all_ranks(self.groups, module, params, buffers)
        self._handle = None
        if params:
            self._handle = FlatParamHandle(module, params, self.groups, sharding_strategy, use_orig_params, self.comm,
                                           mixed_precision)
            self._handle.take_over_params()
            if not use_orig_params:
                # on the wrapped module, as torch: named "_fsdp_wrapped_module._flat_param"
                module.register_parameter("_flat_param", self._handle.flat_param)
        self.training_state = TrainingState.IDLE
        self._root: FullyShardedDataParallel | None = None  # set at the first forward (_lazy_init)
        self._root_step: RootStep | None = None  # the root's only
        self._sync_gradients = True  # False inside no_sync()
        self._tracer = None  # a tools.tracing.Tracer while one is attached
        self._reshard_only_hook = None  # a frozen unit's post-backward, on its inputs (this iteration's)
        self._post_backward_hook = None  # on the handle's gradient leaf, once it requires grad
        self._register_post_backward_hook()
        install_optimizer_check()

    def _register_post_backward_hook(self) -> None:
        h = self._handle
        if h is not None and h.unsharded.requires_grad and self._post_backward_hook is None:
            # A weak reference: a hook lives in the tensor's C++ side, where Python's garbage collector
            # cannot see it, so a hook holding the unit would keep every dropped model alive (torch FSDP1's does)
            unit = weakref.ref(self)
            self._post_backward_hook = h.unsharded.register_post_accumulate_grad_hook(
                lambda _leaf: post_backward(unit()))

    # ------------------------------------------------------------------ what users see
    @property
    def module(self) -> nn.Module:
        return self._fsdp_wrapped_module

    @property
    def flat_param(self) -> nn.Parameter | None:
        """This unit's local 1-D shard (torch: ``_flat_param``); None if the unit owns no parameters."""
        return self._handle.flat_param if self._handle is not None else None

    @property
    def _flat_param(self) -> nn.Parameter | None:
        """torch's name for :attr:`flat_param` (code written for torch reads ``unit._flat_param``)."""
        return self.flat_param

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:  # forward attributes of the wrapped module, as torch does
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
        uninitialized = self._root is None
        with full_params.summon_full_params(self, recurse=False) if uninitialized else contextlib.nullcontext():
            return super().apply(fn)

    @property
    def is_root(self) -> bool:
        """True for the unit whose forward ran first (known after the first forward)."""
        return self._root is self

    def attach_tracer(self, tracer) -> None:
        """Report this unit's events to ``tracer`` (a ``tools.tracing.Tracer``), or stop with None."""
        self._tracer = tracer
        if self._handle is not None:
            self._handle.tracer = tracer

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

    summon_full_params = staticmethod(full_params.summon_full_params)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the global gradient norm over all shards (collective); returns the total norm, as torch."""
        if self._root is None:  # before any forward: this unit is the root (torch's lazy init)
            self._init_root()
        return full_params.clip_grad_norm_(self, max_norm, norm_type)

    def _init_root(self) -> None:
        self._root_step = init_root(self)  # root.py
        opts.check_homogeneous(self._root_step.units)  # torch_options.py
        for unit in self._root_step.units:  # torch's lazy init: the dtypes are fixed from now on
            if unit._handle is not None:
                adopt_dtype(unit._handle)
                unit._handle.dtype_fixed = True

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
        """Load a state dict of the type set by ``FSDP.state_dict_type``; each rank keeps its shard.

        Returns torch's ``_IncompatibleKeys(missing_keys, unexpected_keys)``, plain names.
        """
        return sd_type.load_typed_state_dict(self, state_dict, strict=strict)

    state_dict_type = staticmethod(sd_type.state_dict_type)
    set_state_dict_type = staticmethod(sd_type.set_state_dict_type)
    get_state_dict_type = staticmethod(sd_type.get_state_dict_type)
    optim_state_dict = staticmethod(optim_state.optim_state_dict)
    optim_state_dict_to_load = staticmethod(optim_state.optim_state_dict_to_load)

    # ------------------------------------------------------------------ forward
    def forward(self, *args, **kwargs):
        if self._root is None:
            self._init_root()  # the first unit to run forward is the root
        mp, root, h = self.mixed_precision, self._root, self._handle
        step = root._root_step
        if self.is_root:
            self._root_pre_forward()
            if mp is not None and mp.cast_root_forward_inputs:
                args, kwargs = cast_floating((args, kwargs), mp.param_dtype)
        if mp is not None and mp.cast_forward_inputs and h is not None:
            args, kwargs = cast_floating((args, kwargs), mp.param_dtype)
        if h is not None and not h.unsharded.requires_grad:
            register_reshard_only_hook(self, args, kwargs)  # backward.py
        self._register_post_backward_hook()  # a unit unfrozen after wrapping (use_orig_params)
        awaiting = self.training_state is TrainingState.AWAITING_BACKWARD  # called twice in one step
        self.training_state = TrainingState.FORWARD
        if h is not None:
            step.order.record_pre_forward(self)
            h.unshard()
            if root.forward_prefetch:
                prefetch(step.order.next_in_forward(self), step.units, root.limit_all_gathers, in_backward=False)
            h.use_unsharded_views(in_forward=True)
            register_free_before_concat(self, awaiting)  # backward.py
        try:
            with span(self._tracer, "forward", h.name if h is not None else "root"):
                out = self._fsdp_wrapped_module(*args, **kwargs)
        finally:
            self.training_state = TrainingState.AWAITING_BACKWARD if awaiting else TrainingState.IDLE
            if h is not None:
                step.order.record_post_forward(self)
                if h.casts_unsharded or (not self.is_root and self.sharding_strategy in RESHARD_AFTER_FORWARD):
                    h.reshard()  # (torch frees NO_SHARD's low-precision copy after every forward, the root's too)
                if h.use_orig_params:
                    h.use_sharded_views()
        if torch.is_grad_enabled():
            tensors = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
            for t in tensors:
                t.register_hook(functools.partial(pre_backward, self))
            if tensors:
                self.training_state = TrainingState.AWAITING_BACKWARD
                if self.is_root:
                    step.versions_at_forward = shard_versions(step)
        return out

    def _root_pre_forward(self) -> None:
        step = self._root_step
        for unit in step.units:  # use_orig_params: requires_grad set on an original after wrapping
            if unit._handle is not None:
                unit._handle.refresh_requires_grad()
        if step.versions_at_forward is not None and torch.is_grad_enabled():
            check_versions(step)
        elif step.versions_at_forward is None:
            # Idle: a full buffer kept since its gather (the root's after a forward; SHARD_GRAD_OP's under
            # no_sync or after a no-grad forward) is used again, as in torch, unless its shard has changed
            # since (an optimizer step): then it is stale, gather again (torch would use it as it is).
            for unit in step.units:
                if unit._handle is not None and unit._handle.stale():
                    unit._handle.reshard()

    # ------------------------------------------------------------------ no_sync
    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate unsharded gradients locally, no communication; put the backward INSIDE the context.

        Costs a full (unsharded) gradient per unit until the next synced backward.
        """
        inside = units(self)
        old = [u._sync_gradients for u in inside]
        for u in inside:
            u._sync_gradients = False
        try:
            yield
        finally:
            for u, o in zip(inside, old):
                u._sync_gradients = o


FSDP = FullyShardedDataParallel


def _is_managed(p: torch.Tensor) -> bool:
    return getattr(p, "_minifsdp_flat", False) or hasattr(p, "_minifsdp_owner")


def _own_buffers(module: nn.Module) -> list[torch.Tensor]:
    nested = {id(b) for m in units(module) for b in m.buffers()}
    return [b for b in module.buffers() if id(b) not in nested]
