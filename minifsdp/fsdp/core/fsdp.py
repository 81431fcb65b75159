"""FullyShardedDataParallel (chapter 2): a module whose parameters live sharded across ranks.

    model = FullyShardedDataParallel(TinyGPT(), auto_wrap_policy=partial(transformer_auto_wrap_policy,
                                                                         transformer_layer_cls={Block}))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)   # AFTER wrapping: it steps the local shards
    loss = model(x, y); loss.backward(); model.clip_grad_norm_(1.0); opt.step(); opt.zero_grad()

Each wrapped module is a *unit* with one flat parameter.  A step, for a root with two nested
units, FULL_SHARD (AG = all-gather, RS = reduce-scatter):

    forward:   AG root | AG b0, run b0, free b0 | AG b1, run b1, free b1 | run root tail
    backward:           AG b1, grad b1, RS b1, free | AG b0, grad b0, RS b0, free | grad root, ...
    end:       final callback at the root: the last RS finishes, every shard has its gradient

Two objects per unit, and calls go one way: this class decides *when* (hooks, order,
TrainingState); its ``FlatParamHandle`` (``handle.py``) does *what* (tensors, collectives).
The forward is here, the backward's hooks in ``backward.py``.

Note (root): the outermost unit, whose forward runs first.  At that first forward it lists
every unit below it and casts floating-point buffers to ``MixedPrecision.buffer_dtype`` once;
its ``RootStep`` keeps the units' execution order and whether the final callback is queued.

This is the class to read; ``minifsdp.FSDP`` (``minifsdp/fsdp/fully_sharded.py``) extends it
with the rest of torch FSDP1's API, and this one never imports that.
"""

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


@dataclass
class RootStep:
    """What only the root keeps: every unit below it, the order they ran in, this step's bookkeeping."""

    units: list  # every unit under the root, the root first
    order: ExecutionOrder = field(default_factory=ExecutionOrder)
    final_callback_queued: bool = False  # at most one final callback per backward
    buffer_dtypes: dict = field(default_factory=dict)  # (id(module), name) -> dtype before buffer_dtype's cast


def check_flattenable(module: nn.Module, params: list, mixed_requires_grad: bool = False) -> None:
    """One flat parameter has one dtype and one ``requires_grad``: refuse a unit that mixes them."""
    named = [(n, p) for n, p in module.named_parameters() if p in set(params)]
    dtypes = {p.dtype: n for n, p in reversed(named)}  # each dtype's first parameter
    if len(dtypes) > 1:
        raise ValueError(f"FSDP unit mixes parameter dtypes ({', '.join(f'{n}: {d}' for d, n in dtypes.items())}); "
                         "one flat parameter has one dtype (torch: 'Must flatten tensors with uniform dtype'). Cast "
                         "the module to one dtype first (module.to(torch.float32)), or wrap the odd part in its unit.")
    if not mixed_requires_grad and len({p.requires_grad for _, p in named}) > 1:
        raise ValueError(f"FSDP unit mixes frozen ({', '.join(n for n, p in named if not p.requires_grad)[:80]}...) "
                         "and trainable parameters; one flat parameter has one requires_grad. Pass "
                         "use_orig_params=True, or wrap the frozen part in its own unit.")


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

    summon_full_params = staticmethod(full_params.summon_full_params)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the global gradient norm over all shards (collective); returns the total norm, as torch."""
        if self._root is None:  # before any forward: this unit is the root (torch's lazy init)
            self._init_root()
        return full_params.clip_grad_norm_(self, max_norm, norm_type)

    def state_dict(self, *args, **kwargs):
        """The full state dict: every parameter whole, under the plain model's names, on every rank."""
        return full_params.full_state_dict(self)

    def load_state_dict(self, state_dict, *args, **kwargs):
        """Load a full state dict (plain names); each rank keeps its shard (torch's key checks: the public class)."""
        full_params.load_full_state_dict(self, state_dict)

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate unsharded gradients locally, no communication; put the backward INSIDE the context.
        Costs a full (unsharded) gradient per unit until the next synced backward."""
        inside = units(self)
        old = [u._sync_gradients for u in inside]
        for u in inside:
            u._sync_gradients = False
        try:
            yield
        finally:
            for u, o in zip(inside, old):
                u._sync_gradients = o

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
