"""One FSDP training step, read top to bottom in the order it happens (chapters 2 and 4.1).

    model = FullyShardedDataParallel(TinyGPT(), auto_wrap_policy=partial(transformer_auto_wrap_policy,
                                                                         transformer_layer_cls={Block}))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)   # AFTER wrapping: it steps the local shards
    loss = model(x, y); loss.backward(); opt.step(); opt.zero_grad()

Each wrapped module is a *unit* that owns one flat parameter.  The class below is written in
the step's order, one section per phase:

    0. wrap          flatten each unit's parameters, keep this rank's 1/N        __init__
    1. forward       pre-forward: all-gather; run; post-forward: free or keep    forward, _pre_forward,
                                                                                 _post_forward
    2. backward      pre-backward: all-gather again; autograd computes the       _pre_backward_hook,
                     unit's full gradient; post-backward: free, reduce-scatter   _post_backward_hook
    3. end           wait for every reduction; every unit back to IDLE           _post_backward_final_callback
    4. optimizer     opt.step() updates the shard: nothing for FSDP to do        (section 4, a comment)

One FULL_SHARD step of a root and two nested units b0, b1, BACKWARD_PRE, on a CPU, event by event as recorded
(``tests/test_step_picture.py``; torch FSDP1's come in the same order).  AG x: all-gather x and wait; prefetch AG
x: start it, wait later (wait AG x); free x: drop x's full parameters; RS x: reduce-scatter (on a CPU, in the hook):

    forward   pre root: AG root | (embeddings) | pre b0: AG b0 | (b0) | post b0: free b0
              pre b1: AG b1 | (b1) | post b1: free b1 | (head, loss) | post root (root stays: its backward is next)
    backward  pre root: queue the final callback, prefetch AG b1 | (loss, head)
              pre b1: wait AG b1, prefetch AG b0 | (b1) | post b1: free b1, RS b1
              pre b0: wait AG b0 | (b0) | post b0: free b0, RS b0 | (embeddings) | post root: free root, RS root
    end       final callback (no reduction left in flight: every unit IDLE, flat_param.grad its shard's gradient)

Why gather again in the backward?  FULL_SHARD freed b0's parameters right after its forward
(that is where its memory saving comes from), but b0's backward needs them: the Linear's weight
gradient is computed from its input, its input gradient from its weight.  SHARD_GRAD_OP keeps them
instead and pays their memory between the forward and the backward.  Which one happens is read
from the unit's :class:`ShardingPlan` (``strategy.py``), never from the strategy's name.

Calls go one way: this class decides *when* (hooks, order, ``TrainingState``); its ``FlatParamHandle``
(``handle.py``) and ``UnitGradient`` (``gradient.py``) do *what* (tensors, collectives), as torch's
split: these methods mirror the functions of ``torch/distributed/fsdp/_runtime_utils.py`` they name.

Note (root): the outermost unit, whose forward runs first (torch's ``_lazy_init`` finds it); its
``RootState`` keeps every unit below it, their execution order, whether the final callback is queued.
The lines ``for ext in self._extensions`` are where torch's wider API joins (``extension.py``; none by default).
"""

import contextlib
import weakref
from dataclasses import dataclass, field
from enum import Enum, auto
from functools import partial

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.utils import _apply_to_tensors

from minifsdp.comm import get_collectives
from minifsdp.fsdp.core.flat_param import build_layout
from minifsdp.fsdp.core.handle import FlatParamHandle, HandleState
from minifsdp.fsdp.core.mixed_precision import MixedPrecision, cast_buffers, cast_floating
from minifsdp.fsdp.core.prefetch import BackwardPrefetch, ExecutionOrder, FreeEvents
from minifsdp.fsdp.core.strategy import ShardingPlan, resolve_groups
from minifsdp.fsdp.core.units import Unit, clean_name, flattened_params, units
from minifsdp.fsdp.core.wrap import recursive_wrap


class TrainingState(Enum):  # where a unit is in its step (core/state.py draws the machine)
    IDLE = auto()  # between steps: the local shard only (the root may keep its full parameters)
    FORWARD = auto()  # inside its forward: full parameters gathered, the module's names point into them
    AWAITING_BACKWARD = auto()  # forward done, outputs need a gradient; parameters freed again (FULL_SHARD)
    PRE_BACKWARD = auto()  # autograd reached its outputs: parameters gathered again, its gradient computing
    POST_BACKWARD = auto()  # its full gradient went to the reduce-scatter
    SUMMON_FULL_PARAMS = auto()  # inside summon_full_params: full parameters, outside autograd

@dataclass
class RootState:
    """What only the root keeps from its first forward on: every unit below it, the order they ran in, the limiter."""
    units: list  # every unit under the root, the root first
    order: ExecutionOrder = field(default_factory=ExecutionOrder)
    final_callback_queued: bool = False  # at most one final callback per backward
    buffer_dtypes: dict = field(default_factory=dict)  # (id(module), name) -> dtype before buffer_dtype's cast
    free_events: FreeEvents = field(default_factory=FreeEvents)  # limit_all_gathers' (prefetch.py)

class FullyShardedDataParallel(Unit):
    """Shard ``module``'s parameters over ``process_group``; arguments named and meant as torch's.

    Args:
        module: the module to shard (all parameters and buffers on one device).
        process_group: the ranks to shard over (default: all); HYBRID_SHARD: ``(shard_group, replicate_group)``.
        sharding_strategy: a :class:`ShardingStrategy` (None: FULL_SHARD, as torch); read as a :class:`ShardingPlan`.
        auto_wrap_policy: e.g. ``partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})``.
        backward_prefetch: ``BackwardPrefetch.BACKWARD_PRE`` (torch's default), ``BACKWARD_POST`` or None.
        mixed_precision: a :class:`MixedPrecision` (fp32 shards, compute in ``param_dtype``).
        forward_prefetch, limit_all_gathers: prefetch in the forward too; cap prefetching (``prefetch.py``).
        collectives: ``"torch"`` (torch.distributed's) or one of ours (``minifsdp.comm.COLLECTIVE_KINDS``).
        extensions: this unit's :class:`~minifsdp.fsdp.core.extension.Extension` s (auto-wrapped units get none).
    """

    # ================================================================== 0. wrap: flatten and shard
    # torch: FullyShardedDataParallel.__init__ -> _init_utils.py's _init_param_handle_from_module.
    def __init__(self, module: nn.Module, process_group=None, sharding_strategy=None, auto_wrap_policy=None,
                 backward_prefetch: BackwardPrefetch | None = BackwardPrefetch.BACKWARD_PRE,
                 mixed_precision: MixedPrecision | None = None, forward_prefetch: bool = False,
                 limit_all_gathers: bool = True, collectives: str = "torch", extensions=()):
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"FSDP wraps an nn.Module, got {type(module).__name__}")
        if not dist.is_initialized():
            raise RuntimeError("FSDP needs a process group: call dist.init_process_group first "
                               "(or run your function with minifsdp.spawn).")
        # what the strategy decides, as data (strategy.py)
        plan = ShardingPlan.of(sharding_strategy)
        self.groups = resolve_groups(plan, process_group)
        self.plan = plan = plan.on(self.groups)
        self.sharding_strategy = plan.strategy  # (torch's attribute)
        # minifsdp.comm: ours or torch.distributed's, one interface
        self.comm = get_collectives(collectives)
        self.mixed_precision, self.limit_all_gathers = mixed_precision, limit_all_gathers
        self.backward_prefetch, self.forward_prefetch = backward_prefetch, forward_prefetch
        self._extensions, self.training_state = list(extensions), TrainingState.IDLE
        if auto_wrap_policy is not None:  # children first (post-order): each takes its parameters before we do
            kwargs = dict(process_group=process_group, sharding_strategy=plan.strategy, collectives=collectives,
                          backward_prefetch=backward_prefetch, mixed_precision=mixed_precision,
                          forward_prefetch=forward_prefetch, limit_all_gathers=limit_all_gathers)
            recursive_wrap(module, auto_wrap_policy, partial(type(self), **kwargs), only_wrap_children=True)
        self._fsdp_wrapped_module = module
        # The unit's own parameters (none that a nested unit took) in one flat parameter; no handle if none.
        # After this, ``module.parameters()`` yields one 1-D shard where it yielded the originals.
        taken = flattened_params(module)
        params = [p for p in module.parameters() if id(p) not in taken]
        layout = build_layout(module, params, self.groups.shard_size if plan.shards_params else 1) if params else None
        for ext in self._extensions:  # torch's keywords may keep some out, or lay them out anew
            layout = ext.on_wrap(self, layout)
        self._handle = None if layout is None else FlatParamHandle(module, layout, self.groups, plan, self.comm,
                                                                   mixed_precision)
        # set at the first forward (_lazy_init): the root unit; on the root only, its RootState; False inside no_sync()
        self._root, self._root_state, self._sync_gradients = None, None, True
        if self._handle is not None:
            self._handle.take_over_params()
            # wrapped: the parameters are sharded, as after every reshard
            for ext in self._extensions:
                ext.after_reshard(self)
            unit = weakref.ref(self)  # the hook lives in C++, unseen by Python's GC: it must not hold the unit
            self._handle.post_backward_hook = lambda *_: unit()._post_backward_hook()
            self._handle.register_post_backward_hook()  # once its gradient leaf requires grad (handle.py)

    # ================================================================== 1. forward
    # torch: FullyShardedDataParallel.forward: _root_pre_forward, _pre_forward, the module, _post_forward.
    def forward(self, *args, **kwargs):
        # a checkpoint recomputing it inside its backward (autograd's task id is -1 outside one: not a backward
        # that died in PRE_BACKWARD): gathered already, no hooks, as torch's _pre_forward and _post_forward
        if self.training_state is TrainingState.PRE_BACKWARD and torch._C._current_graph_task_id() != -1:
            return self._fsdp_wrapped_module(*args, **kwargs)
        # a second forward before the backward
        again = self.training_state is TrainingState.AWAITING_BACKWARD
        args, kwargs = self._pre_forward(args, kwargs)
        try:
            out = self._fsdp_wrapped_module(*args, **kwargs)
        finally:
            self._post_forward(again)
        self._register_pre_backward_hooks(out)
        for ext in self._extensions:
            ext.after_forward(self, out)
        return out

    def _lazy_init(self) -> None:
        """torch's ``_lazy_init``: the first forward makes this unit the root of every unit below it."""
        self._root_state = root_state = RootState(units(self))
        # MixedPrecision.buffer_dtype, once (torch casts them before it checks the units, too)
        root_state.buffer_dtypes = cast_buffers(root_state.units)
        names = {id(m): clean_name(n) or "root" for n, m in self.named_modules()}
        for unit in root_state.units:
            if unit._handle is not None:
                unit._handle.name = names[id(unit)]  # its module path, for messages and timelines
            if unit is not self and unit.is_root:
                raise RuntimeError("a nested FSDP unit ran forward on its own before its parent; "
                                   "call the outermost FSDP module")
            # a plain reference, not a registered submodule (no cycle)
            unit.__dict__["_root"] = self
        for ext in self._extensions:
            ext.on_lazy_init(self)

    def _pre_forward(self, args, kwargs):
        """torch's ``_root_pre_forward`` and ``_pre_forward``: cast the inputs, gather the parameters, and point
        the module's names at them.  Why every forward?  Between uses this rank holds 1/N of them.

        torch spreads this over ``_root_pre_forward`` (``_lazy_init``, the root's input cast), ``_pre_forward``
        (record the order, the post-backward hook, cast inputs) and ``_pre_forward_unshard`` (gather unless
        prefetched, make the compute stream wait for the all-gather's, forward prefetch).  Where torch makes a
        stream wait, ours blocks in ``FlatParamHandle.wait_unshard`` until the all-gather's work is done."""
        if self._root is None:
            # the first unit to run forward is the root
            self._lazy_init()
        mp, h = self.mixed_precision, self._handle
        if mp and (self.is_root and mp.cast_root_forward_inputs or h is not None and mp.cast_forward_inputs):
            args, kwargs = cast_floating((args, kwargs), mp.param_dtype)
        for ext in self._extensions:
            ext.before_forward(self, args, kwargs)
        if h is not None:  # a unit that has started to require grad since wrapping
            h.register_post_backward_hook()
        self.training_state = TrainingState.FORWARD
        root_state = self._root._root_state
        root_state.order.record_pre_forward(self)
        if h is not None:
            prefetched = h.views_prefetched or h.state is HandleState.GATHERING  # prefetch.py, Note (views)
            h.views_prefetched = False
            h.wait_unshard() if prefetched else self._unshard()  # (prefetched: only wait, as torch)
            if not prefetched:  # module.weight ... become views of the full buffer, as the module expects
                h.use_unsharded_views()
                for ext in self._extensions:
                    ext.after_unshard(self)
            if self._root.forward_prefetch:
                self._prefetch(root_state.order.next_in_forward, in_backward=False)
        return args, kwargs

    def _post_forward(self, again: bool) -> None:
        """torch's ``_post_forward`` (``_post_forward_reshard`` decides alike): free the parameters if the plan
        says so (never the root's: its backward comes at once, so freeing them would only gather them again)."""
        if self._handle is not None:
            self._end_use(free=not self.is_root and self.plan.frees_after_forward)
            # the backward runs in the reverse order
            self._root._root_state.order.record_post_forward(self)
        self.training_state = TrainingState.AWAITING_BACKWARD if again else TrainingState.IDLE

    def _register_pre_backward_hooks(self, out) -> None:
        """torch's ``_register_pre_backward_hooks``: autograd calls :meth:`_pre_backward_hook` when it reaches
        one of the outputs, that is, just before it needs this unit's parameters again.  Why the outputs?
        Autograd has no "this module's backward begins" event: an output's gradient is the first thing it gets.
        Found by torch FSDP1's walk (``_apply_to_tensors``), into dataclasses and dict subclasses (leaves to
        ``tree_flatten``: no hook); torch returns the nest it rebuilt (a dict subclass as a dict), ours the output."""
        if torch.is_grad_enabled():
            if self.is_root:  # (torch: a backward that died before its callback ran leaves no flag set)
                self._root_state.final_callback_queued = False
            hooked = []  # flags, never the tensors: torch's walk is a closure that calls itself, a cycle only the
            # garbage collector frees, so a list of outputs it filled would outlive the backward (2 KB in the MLP)
            _apply_to_tensors(lambda t: (t.requires_grad and hooked.append(t.register_hook(self._pre_backward_hook)
                                                                             is not None)) or t, out)
            if hooked:
                self.training_state = TrainingState.AWAITING_BACKWARD

    # ================================================================== 2. backward
    # Autograd runs the units' backwards in the reverse of their forwards; FSDP acts at each one's two ends.
    def _pre_backward_hook(self, grad):
        """torch's ``_pre_backward_hook``: autograd reached one of this unit's outputs; gather its parameters
        again (once per backward), and start gathering the next unit's early (BACKWARD_PRE).

        Why queue the final callback here?  Autograd runs a callback queued during a backward once that whole
        backward is done, and this is our first hook to fire in it (normally the root's, nearest the loss).  torch
        queues it from the root's only: a backward that misses the root's outputs (a loss on an inner output kept
        aside) ends there with units mid-backward, sharded gradients outside ``.grad`` (``test_fsdp_outputs.py``)."""
        root, root_state = self._root, self._root._root_state
        if not root_state.final_callback_queued:  # the first pre-backward of this backward (normally the root's)
            root_state.final_callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(root._post_backward_final_callback)
        if self.training_state in (TrainingState.PRE_BACKWARD, TrainingState.POST_BACKWARD):
            # another of its outputs already brought it here
            return
        self.training_state = TrainingState.PRE_BACKWARD
        h = self._handle
        if h is not None:
            # the forward's views see the numbers again: the same storage (handle.py, Note)
            self._unshard()
            if root.backward_prefetch is BackwardPrefetch.BACKWARD_PRE:
                self._prefetch(root_state.order.next_in_backward, in_backward=True)
            for ext in self._extensions:
                ext.after_unshard(self)
            h.gradient.prepare()

    def _post_backward_hook(self) -> None:
        """torch's ``_post_backward_hook``: autograd has summed this unit's full gradient (a hook on its leaf);
        free the parameters, then reduce the gradient so each rank keeps the sum of its 1/N."""
        h, root_state = self._handle, self._root._root_state
        self.training_state = TrainingState.POST_BACKWARD
        # torch's order: free the parameters, then the BACKWARD_POST prefetch, then reduce, so the next
        # unit's all-gather is issued first.  Freeing them leaves the full gradient (its own tensor) in place.
        self._post_backward_reshard()
        if not self._sync_gradients:  # no_sync(): keep the full gradient, where zero_grad() can reach it
            h.gradient.keep_unsharded()
            for ext in self._extensions:
                ext.after_reduce(self)
            return
        # At most one reduction in flight: finish the previous unit's (it had this unit's whole backward
        # to complete), so its full gradient is freed now, not at the end of the backward.  torch on a GPU
        # instead queues every reduction on one _post_backward_stream, which runs them in order, and makes the
        # compute stream wait for that stream once, in _post_backward_final_callback.
        for unit in [u for u in root_state.units if u is not self and u._handle is not None] + [self]:
            unit._finish_reduction()
        h.gradient.start_reduce()
        if h.gradient.reduces_in_hook:
            self._finish_reduction()

    def _post_backward_reshard(self) -> None:
        """torch's ``_post_backward_reshard``: free the parameters (as the plan says), then the BACKWARD_POST
        prefetch of the unit the backward needs next."""
        self._end_use(free=self._should_free_in_backward())
        if self._root.backward_prefetch is BackwardPrefetch.BACKWARD_POST:
            self._prefetch(self._root._root_state.order.next_in_backward, in_backward=True)

    def _should_free_in_backward(self) -> bool:
        """torch's ``_should_free_in_backward``: a plan that frees after the backward does, except that under
        no_sync a unit that keeps its parameters after the forward keeps them for the next micro-batch too
        (why: ``strategy.py``, Note (no_sync))."""
        return self.plan.frees_after_backward and (self._sync_gradients or self.plan.frees_after_forward)

    # ================================================================== 3. end of backward
    def _post_backward_final_callback(self) -> None:
        """torch's ``_post_backward_final_callback`` (queued by the first pre-backward): autograd is done;
        finish every reduction still in flight, free what is left, every unit back to IDLE.  (torch's first makes
        the compute stream wait for the reduction streams, then ``_ExecOrderData.next_iter``, then
        ``_catch_all_reshard`` and ``_finalize_params`` for every unit; ours waits unit by unit.)

        Why a catch-all reshard?  A unit's post-backward hook runs only if its parameters got a gradient; one whose
        pre-backward gathered them but whose parameters got none (its output reached the loss by a path that skips
        them) would stay gathered into the next step, as would one a backward prefetch gathered for a backward that
        never came.  Else one the backward never reached stays as its forward left it, as torch's (SHARD_GRAD_OP's
        kept: the next forward gathers nothing; ``test_fsdp_regimes_torch.py``)."""
        for unit in self._root_state.units:
            if unit._handle is not None:
                unit._finish_reduction()
                prefetched = unit.training_state is TrainingState.AWAITING_BACKWARD and unit.plan.frees_after_forward \
                    and unit._handle.state is not HandleState.SHARDED  # a backward prefetch it never used
                if unit.training_state is TrainingState.PRE_BACKWARD or prefetched:  # gathered, never freed
                    unit._handle.wait_unshard()
                    unit._end_use(free=unit._should_free_in_backward())
            unit.training_state = TrainingState.IDLE
            for ext in unit._extensions:
                ext.after_backward(unit)
        self._root_state.final_callback_queued = False
        self._root_state.order.end_iteration()

    # ================================================================== 4. the optimizer step
    # Nothing to do: ``model.parameters()`` yields each unit's ``flat_param``, this rank's shard, and
    # ``flat_param.grad`` holds the shard of the averaged gradient, so ``opt.step()`` updates 1/N of the
    # model (and keeps 1/N of Adam's state) with no communication.  The next forward's all-gather shows
    # every rank the updated parameters.

    # ================================================================== helpers of the phases above
    def _unshard(self) -> None:
        """torch's ``_unshard``: gather this unit's parameters and wait for them (prefetched: only wait, as torch)."""
        if self._handle.state is not HandleState.GATHERING:
            self._start_unshard()
        self._handle.wait_unshard()

    def _start_unshard(self, prefetch: bool = False) -> None:
        """Issue the all-gather and return: the half of :meth:`_unshard` a prefetch runs (it waits later)."""
        for ext in self._extensions:
            ext.before_unshard(self, prefetch)
        # limit_all_gathers (prefetch.py, Note (the limit)); the queue stays empty without it
        self._root._root_state.free_events.wait_before_all_gather()
        self._handle.start_unshard()

    def _end_use(self, free: bool) -> None:
        """torch's ``_reshard``: a use ends; free the full parameters (``free``) or keep them for the next one."""
        frees = free and self._root.limit_all_gathers and self._handle.state is not HandleState.SHARDED
        self._handle.end_use(free)
        if frees:  # (after the free, as torch's _reshard records its event)
            self._root._root_state.free_events.record_free(self._handle.flat_param.device)
        for ext in self._extensions:
            ext.after_reshard(self)

    def _prefetch(self, next_of, in_backward: bool) -> None:
        """torch's ``_prefetch_handle``: start the all-gather of ``next_of(self)``, the unit the recorded order says
        comes next, if it needs one (still SHARDED: not there, nor on its way) and, in the backward, if its backward is
        still to come (torch's ``_get_handle_to_prefetch``); in the forward, make its views too (NO_SHARD's: only
        them), the target in FORWARD state meanwhile, once per forward (``prefetch.py``, Note (views))."""
        h = getattr(target := next_of(self), "_handle", None)  # (forward: a gathered unit still gets views here)
        if h is None or h.state is not HandleState.SHARDED and (in_backward or h.views_prefetched):
            return
        if in_backward and target.training_state is TrainingState.AWAITING_BACKWARD:
            target._start_unshard(prefetch=True)
        elif not in_backward:
            before, target.training_state = target.training_state, TrainingState.FORWARD
            target._start_unshard(prefetch=True)
            target._handle.use_unsharded_views()
            target._handle.views_prefetched = True
            for ext in target._extensions:
                ext.after_unshard(target)
            target.training_state = before

    def _finish_reduction(self) -> None:
        """Wait for this unit's reduction in flight, if any, and tell the extensions its gradient is there."""
        if self._handle.gradient.finish_reduce():
            for ext in self._extensions:
                ext.after_reduce(self)

    # ================================================================== outside the step
    # (``module``, ``flat_param`` and ``is_root`` are the base class's: ``units.py``)
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
