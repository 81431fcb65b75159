"""FullyShardedDataParallel (chapter 2): a module whose parameters live sharded across ranks.

    model = FullyShardedDataParallel(TinyGPT(), auto_wrap_policy=partial(transformer_auto_wrap_policy,
                                                                         transformer_layer_cls={Block}))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)   # AFTER wrapping: it steps the local shards
    loss = model(x, y); loss.backward(); model.clip_grad_norm_(1.0); opt.step(); opt.zero_grad()

Each wrapped module is a *unit* with one flat parameter (``flat_param.py``).  A step, for
a root with two nested units, FULL_SHARD (AG = all-gather, RS = reduce-scatter):

    forward:   AG root | AG b0, run b0, free b0 | AG b1, run b1, free b1 | run root tail
    backward:           AG b1, grad b1, RS b1, free | AG b0, grad b0, RS b0, free | grad root, ...
    end:       final callback at the root: the last RS finishes, every shard has its gradient

Two objects per unit, each with one job, and calls go one way (unit -> handle):

    FullyShardedDataParallel (this module)   hooks, order, TrainingState: decides *when*
    FlatParamHandle (``handle.py``)           tensors and collectives, HandleState: does *what*

The forward is here, the backward's hooks in ``backward.py``.

Note (root): the outermost unit whose forward runs first is the root.  At that first forward
it lists every unit below it, tells each who its root is, and casts floating-point buffers to
``MixedPrecision.buffer_dtype`` once.  Its ``RootStep`` keeps the step's bookkeeping: the units'
execution order (``prefetch.py``), whether the final callback is queued, and the shards'
versions at a forward awaiting its backward, so an optimizer step in between is caught.

Note (the optimizer): ``model.parameters()`` after wrapping yields each unit's ``flat_param``
(the local 1-D shard).  Build the optimizer after wrapping.

This is the class to read.  ``minifsdp.FullyShardedDataParallel`` (``minifsdp/fsdp/fully_sharded.py``)
extends it with the rest of torch FSDP1's API; this one never imports that.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
import weakref
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils._pytree import tree_flatten

from minifsdp.comm import get_collectives
from minifsdp.fsdp.core import full_params
from minifsdp.fsdp.core.backward import frees_in_backward, post_backward, pre_backward
from minifsdp.fsdp.core.handle import FlatParamHandle
from minifsdp.fsdp.core.mixed_precision import MixedPrecision, cast_floating
from minifsdp.fsdp.core.prefetch import BackwardPrefetch, ExecutionOrder, prefetch
from minifsdp.fsdp.core.state import TrainingState
from minifsdp.fsdp.core.strategy import RESHARD_AFTER_FORWARD, ShardingStrategy, resolve_groups
from minifsdp.fsdp.core.units import Unit, clean_name, flattened_params, units
from minifsdp.fsdp.core.wrap import recursive_wrap

__all__ = ["FullyShardedDataParallel", "RootStep", "check_flattenable"]


@dataclass
class RootStep:
    """What only the root keeps: every unit below it, the order they ran in, this step's bookkeeping."""

    units: list  # every unit under the root, the root first
    order: ExecutionOrder = field(default_factory=ExecutionOrder)
    final_callback_queued: bool = False  # at most one final callback per backward
    buffer_dtypes: dict = field(default_factory=dict)  # (id(module), name) -> dtype before buffer_dtype's cast


def check_flattenable(module: nn.Module, params: list, mixed_requires_grad: bool = False) -> None:
    """One flat parameter has one dtype and one ``requires_grad``: refuse a unit that mixes them."""
    dtypes = {d: next(n for n, p in module.named_parameters() if p in set(params) and p.dtype == d)
              for d in {p.dtype for p in params}}
    if len(dtypes) > 1:
        raise ValueError(
            "FSDP unit mixes parameter dtypes (" + ", ".join(f"{n}: {d}" for d, n in dtypes.items()) + "); one flat "
            "parameter has one dtype (torch: 'Must flatten tensors with uniform dtype'). Cast the module to one "
            "dtype first (module.to(torch.float32)), or wrap the odd part in its own unit.")
    if not mixed_requires_grad and len({p.requires_grad for p in params}) > 1:
        frozen = [n for n, p in module.named_parameters() if p in set(params) and not p.requires_grad]
        raise ValueError(f"FSDP unit mixes frozen ({', '.join(frozen[:3])}...) and trainable parameters; one flat "
                         "parameter has one requires_grad. Pass use_orig_params=True, or wrap the frozen part in its "
                         "own unit.")


class FullyShardedDataParallel(Unit):
    """Shard ``module``'s parameters over ``process_group``; arguments named and meant as torch's.

    Args:
        module: the module to shard (all parameters and buffers on one device).
        process_group: the ranks to shard over (default: all); HYBRID_SHARD: ``(shard_group, replicate_group)``.
        sharding_strategy: a :class:`ShardingStrategy`.
        auto_wrap_policy: e.g. ``partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})``.
        backward_prefetch: ``BackwardPrefetch.BACKWARD_PRE`` (torch's default), ``BACKWARD_POST`` or None.
        mixed_precision: a :class:`MixedPrecision` (fp32 shards, compute in ``param_dtype``).
        forward_prefetch: prefetch in the forward too, in the first iteration's order.
        limit_all_gathers: no prefetch while two non-root units' full parameters are alive.
        collectives: ``"torch"`` (torch.distributed's) or one of ours (``minifsdp.comm.COLLECTIVE_KINDS``).
    """

    def __init__(self, module: nn.Module, process_group=None, sharding_strategy=ShardingStrategy.FULL_SHARD,
                 auto_wrap_policy=None, backward_prefetch: BackwardPrefetch | None = BackwardPrefetch.BACKWARD_PRE,
                 mixed_precision: MixedPrecision | None = None, forward_prefetch: bool = False,
                 limit_all_gathers: bool = True, collectives: str = "torch"):
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"FSDP wraps an nn.Module, got {type(module).__name__}")
        if not dist.is_initialized():
            raise RuntimeError("FSDP needs a process group: call dist.init_process_group first "
                               "(or run your function with minifsdp.spawn).")
        if mixed_precision is not None and not isinstance(mixed_precision, MixedPrecision):
            raise TypeError("mixed_precision takes a MixedPrecision(param_dtype=..., reduce_dtype=...), "
                            f"got {type(mixed_precision).__name__} (there is no mixed_precision=True)")
        if backward_prefetch is not None and not isinstance(backward_prefetch, BackwardPrefetch):
            raise TypeError("backward_prefetch takes BackwardPrefetch.BACKWARD_PRE, BackwardPrefetch.BACKWARD_POST "
                            f"or None, got {backward_prefetch!r}")
        self.groups = resolve_groups(sharding_strategy, process_group)
        if sharding_strategy in (ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP) \
                and self.groups.shard_size == 1:
            warnings.warn("FSDP on 1 rank: nothing to shard, using NO_SHARD (as torch does)", stacklevel=2)
            sharding_strategy = ShardingStrategy.NO_SHARD
        self.sharding_strategy = sharding_strategy
        self.comm = get_collectives(collectives)  # minifsdp.comm: ours or torch.distributed's, one interface
        self.mixed_precision = mixed_precision
        self.backward_prefetch, self.forward_prefetch = backward_prefetch, forward_prefetch
        self.limit_all_gathers = limit_all_gathers
        if auto_wrap_policy is not None:  # children first: each becomes a unit of the same kind
            self._auto_wrap(module, auto_wrap_policy, dict(
                process_group=process_group, sharding_strategy=sharding_strategy, backward_prefetch=backward_prefetch,
                mixed_precision=mixed_precision, forward_prefetch=forward_prefetch,
                limit_all_gathers=limit_all_gathers, collectives=collectives))
        self._fsdp_wrapped_module = module
        self._handle = self._make_handle(module)
        if self._handle is not None:
            self._handle.take_over_params()
        self.training_state = TrainingState.IDLE
        self._root: FullyShardedDataParallel | None = None  # set at the first forward (_init_root)
        self._root_step: RootStep | None = None  # the root's only
        self._sync_gradients = True  # False inside no_sync()
        self._tracer = None  # a tools.tracing.Tracer while one is attached
        self._post_backward_hook = None  # on the handle's gradient leaf, once it requires grad
        self._register_post_backward_hook()

    def _auto_wrap(self, module: nn.Module, policy, kwargs: dict) -> None:
        recursive_wrap(module, policy, lambda m: type(self)(m, **kwargs), only_wrap_children=True)

    def _make_handle(self, module: nn.Module) -> FlatParamHandle | None:
        """The unit's own parameters (none that a nested unit took) in one flat parameter; None if none."""
        taken = flattened_params(module)
        params = [p for p in module.parameters() if id(p) not in taken]
        if not params:
            return None
        check_flattenable(module, params)
        return FlatParamHandle(module, params, self.groups, self.sharding_strategy, self.comm, self.mixed_precision)

    def _register_post_backward_hook(self) -> None:
        h = self._handle
        if h is not None and h.unsharded.requires_grad and self._post_backward_hook is None:
            # A weak reference: the hook lives in C++, where Python's garbage collector cannot see it,
            # so a hook holding the unit would keep every dropped model alive.
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

    def state_dict(self, *args, **kwargs):
        """The full state dict: every parameter whole, under the plain model's names, on every rank."""
        return full_params.full_state_dict(self)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Load a full state dict (plain names); each rank keeps its shard."""
        return full_params.load_full_state_dict(self, state_dict, strict=strict)

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

    # ------------------------------------------------------------------ the root
    def _init_root(self) -> None:
        """The first forward: this unit becomes the root of every unit below it."""
        step = self._root_step = RootStep(units(self))
        for name, unit in self.named_modules():
            if isinstance(unit, Unit) and unit._handle is not None:
                unit._handle.name = clean_name(name) or "root"
        for unit in step.units:
            if unit is not self and unit.is_root:
                raise RuntimeError("a nested FSDP unit ran forward on its own before its parent; "
                                   "call the outermost FSDP module")
            unit.__dict__["_root"] = self  # a plain reference, not a registered submodule (no cycle)
        claimed = set()  # (id(module), name): a buffer takes its own (innermost) unit's buffer_dtype
        for unit in reversed(step.units):
            mp = unit.mixed_precision
            for m in unit.module.modules():
                for name, b in m._buffers.items():
                    if b is None or (id(m), name) in claimed:
                        continue
                    claimed.add((id(m), name))
                    if mp is not None and mp.buffer_dtype is not None and b.is_floating_point() \
                            and b.dtype != mp.buffer_dtype:
                        step.buffer_dtypes[(id(m), name)] = b.dtype
                        m._buffers[name] = b.to(mp.buffer_dtype)

    def _root_pre_forward(self) -> None:
        """A full buffer kept since its gather (the root's; SHARD_GRAD_OP's under no_sync) is used again,
        unless an optimizer step changed its shard since: then it is stale, gather again."""
        if self.training_state is not TrainingState.AWAITING_BACKWARD:
            for unit in self._root_step.units:
                if unit._handle is not None and unit._handle.stale():
                    unit._handle.reshard()

    # ------------------------------------------------------------------ forward
    def forward(self, *args, **kwargs):
        again = self.training_state is TrainingState.AWAITING_BACKWARD  # a second forward before the backward
        args, kwargs = self._pre_forward(args, kwargs)
        h = self._handle
        try:
            tracer = self._tracer
            with tracer.span("forward", h.name if h else "root") if tracer else contextlib.nullcontext():
                out = self._fsdp_wrapped_module(*args, **kwargs)
        finally:
            self._post_forward(again)
        if torch.is_grad_enabled():  # autograd will call pre_backward when it reaches these outputs
            tensors = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
            for t in tensors:
                t.register_hook(functools.partial(pre_backward, self))
            if tensors:
                self.training_state = TrainingState.AWAITING_BACKWARD
        return out

    def _pre_forward(self, args, kwargs):
        """Gather this unit's parameters and point the module's names at them."""
        if self._root is None:
            self._init_root()  # the first unit to run forward is the root
        mp, root, h = self.mixed_precision, self._root, self._handle
        if self.is_root:
            self._root_pre_forward()
            if mp is not None and mp.cast_root_forward_inputs:
                args, kwargs = cast_floating((args, kwargs), mp.param_dtype)
        if mp is not None and mp.cast_forward_inputs and h is not None:
            args, kwargs = cast_floating((args, kwargs), mp.param_dtype)
        self._register_post_backward_hook()  # a unit that has started to require grad since wrapping
        self.training_state = TrainingState.FORWARD
        if h is not None:
            step = root._root_step
            step.order.record_pre_forward(self)
            h.unshard()
            if root.forward_prefetch:
                prefetch(step.order.next_in_forward(self), step.units, root.limit_all_gathers, in_backward=False)
            h.use_unsharded_views(in_forward=True)
        return args, kwargs

    def _post_forward(self, again: bool) -> None:
        """Free the parameters (FULL_SHARD, not the root's: its backward comes at once)."""
        self.training_state = TrainingState.AWAITING_BACKWARD if again else TrainingState.IDLE
        h = self._handle
        if h is not None:
            self._root._root_step.order.record_post_forward(self)
            if h.casts_unsharded or (not self.is_root and self.sharding_strategy in RESHARD_AFTER_FORWARD):
                h.reshard()  # (torch frees NO_SHARD's low-precision copy after every forward, the root's too)
            h.after_forward()

    def _finish_backward(self) -> None:
        """The root's final callback, for this unit: its reduction done, its parameters freed, IDLE."""
        self.training_state = TrainingState.IDLE
        h = self._handle
        if h is not None:
            h.gradient.finish_reduce()
            if frees_in_backward(self):
                h.reshard()
