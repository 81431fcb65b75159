"""The state of one ``fully_shard`` call and the module hooks that drive its group (torch's ``_fsdp_state.py``).

One :class:`FSDPState` per call, stored on its module(s); it owns the call's :class:`FSDPParamGroup` (None if the
call took no parameter).  Hooks, and what each does on one rank::

    module forward pre-hook   pre_forward      root: lazy init once; cast inputs; the group's pre_forward
    module forward hook       post_forward     the group's post_forward; a tensor hook on each output
    output tensor hook        _pre_backward    (the first gradient to reach this module's outputs) the
                                               group's pre_backward; the first one queues _end_of_backward
    input identity (autograd) post_backward    (see param_group: after the module's backward is done)
    autograd engine callback  _end_of_backward (after the whole backward) groups autograd never reached
                                               (no input needed a gradient) reduce now; all back to IDLE

Why the root is special: nothing tells a module it is the outermost one, so the first state whose forward runs
claims it (:meth:`FSDPState.lazy_init`): it shares one context with every state below (the forward order that
prefetching reads), tells them they are not roots, and lets each group finish its setup.  It keeps its own
parameters from forward to backward: its backward comes first and would gather them straight back.  When its
forward ends, it finishes any state whose forward began and did not end (a call over several modules, some not run).

Why a callback at the end of backward: a group's post-backward runs when autograd reaches its inputs' identity
node; a module whose inputs need no gradient (token ids into the root) has none, so the callback reduces those
groups, and finishes the step (forgets the forward order, drops a prefetch no one used).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from torch.autograd import Variable
from torch.distributed.utils import _apply_to_tensors

from minifsdp.fsdp2.core.nest import grad_tensors
from minifsdp.fsdp2.core.param import MixedPrecisionPolicy
from minifsdp.fsdp2.core.param_group import FSDPParamGroup, TrainingState

__all__ = ["FSDPState", "StateContext", "fsdp_state", "cast_tensors", "STATE_ATTR"]

STATE_ATTR = "_minifsdp_fsdp2_state"


def fsdp_state(module: nn.Module) -> FSDPState | None:
    """The state ``fully_shard`` attached to ``module``, or None."""
    return module.__dict__.get(STATE_ATTR)


def cast_tensors(tree: Any, dtype: torch.dtype | None) -> Any:
    """Every floating-point tensor in ``tree`` cast to ``dtype`` (torch's ``_cast_fp_tensor`` over its nests)."""
    if dtype is None:
        return tree
    return _apply_to_tensors(lambda x: x.to(dtype) if x.is_floating_point() and x.dtype != dtype else x, tree)


class StateContext:
    """What the root shares with every state below it, made at the root's first forward."""

    def __init__(self, states: list[FSDPState]):
        self.all_states = states
        self.post_forward_order: list[FSDPParamGroup] = []  # the order forwards ended in (prefetch reads it)
        self.callback_queued = False
        self.iter_forward_root: FSDPState | None = None  # the state whose forward began this iteration's
        self.is_last_backward = True  # False: more backwards before the optimizer step (keep the order)


class FSDPState:
    """Per ``fully_shard`` call: its modules, its group, its hooks."""

    def __init__(self, modules: tuple[nn.Module, ...], group: FSDPParamGroup | None,
                 mp_policy: MixedPrecisionPolicy, auto_reshard: bool):
        self.modules, self.param_group, self.mp_policy = modules, group, mp_policy
        self.auto_reshard = auto_reshard  # reshard_after_forward=None: True, except at the root
        self.is_root: bool | None = None  # unknown until a forward runs
        self.ctx = StateContext([self])  # replaced by the root's at lazy init
        self.training_state = TrainingState.IDLE
        self.forward_prefetch: list[FSDPState] = []  # explicit: gather these in this module's pre-forward
        self.backward_prefetch: list[FSDPState] = []  # explicit: these instead of the implicit prefetch
        for module in modules:
            module.__dict__[STATE_ATTR] = self
        if len(modules) == 1:  # (several modules in one call: the layer above decides when they begin and end)
            modules[0].register_forward_pre_hook(self.pre_forward, prepend=True, with_kwargs=True)
            modules[0].register_forward_hook(self.post_forward)

    # ---------------------------------------------------------------- the root
    def lazy_init(self) -> None:
        """Claim the root (torch's ``_lazy_init``), once: share one context with every state below, name each
        parameter, refuse a weight two calls sharded, and let each group finish its setup."""
        if self.is_root is not None:
            return
        if len(self.modules) > 1:
            raise RuntimeError(f"FSDP requires a single root module but got {list(self.modules)}")
        self.is_root = True
        root, states = self.modules[0], []
        for name, sub in root.named_modules():
            state = fsdp_state(sub)
            if state is None or state in states:
                continue
            if state is not self:
                if state.is_root is not None:
                    raise RuntimeError(f"FSDP state has already been lazily initialized for {name}\n"
                                       "FSDP requires running forward through the root module first")
                state.is_root = False
            states.append(state)
        ctx = StateContext(states)
        if self.auto_reshard and self.param_group is not None:
            self.param_group.reshard_after_forward = False  # its backward comes first: keep the parameters
        names = {id(p): n for n, p in root.named_parameters()}
        modules = {id(m): n for n, m in root.named_modules(remove_duplicate=False)}
        owner: dict[int, FSDPState] = {}
        groups = [s.param_group for s in states if s.param_group is not None]
        for state in states:
            state.ctx = ctx
        for group in groups:
            group.post_forward_order = ctx.post_forward_order
            group.module_fqn = ", ".join(modules.get(id(m), "?") for m in group.modules)
            for p in group.fsdp_params:
                p.fqn = names.get(id(p.sharded_param), p.users[0][1])
                if owner.setdefault(id(p.orig_uid), group) is not group:  # one weight, two copies: they would drift
                    raise ValueError(f"Parameter '{p.fqn}' is shared with a parameter already managed by another "
                                     "FSDP group. For shared/tied parameters, use fully_shard([module_a, module_b]) "
                                     "to place them in the same FSDP group.")
        for group in groups:
            group.lazy_init()

    # ---------------------------------------------------------------- forward
    def pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if self.training_state is TrainingState.PRE_BACKWARD:  # recomputing checkpointed activations in backward
            if self.param_group is not None and not self.param_group.is_unsharded:
                self.param_group.unshard()
                self.param_group.wait_for_unshard()
            return self._cast_inputs(args, kwargs)
        first_in_pass = self.training_state is not TrainingState.FORWARD
        self.training_state = TrainingState.FORWARD
        if first_in_pass:
            self.lazy_init()
            if self.ctx.iter_forward_root is None:
                self.ctx.iter_forward_root = self
        args, kwargs = self._cast_inputs(args, kwargs)
        if self.param_group is not None:
            args, kwargs = self.param_group.pre_forward(args, kwargs)
        if first_in_pass:
            for target in self.forward_prefetch:
                if target.param_group is not None:
                    FSDPParamGroup.prefetch(target.param_group, TrainingState.FORWARD)
        return args, kwargs

    def post_forward(self, module: nn.Module | None, args: tuple, output: Any) -> Any:
        if self.training_state is TrainingState.PRE_BACKWARD:
            return cast_tensors(output, self.mp_policy.output_dtype)
        self._finish_forward(output)
        if self.ctx.iter_forward_root is self:  # the root's forward ended: finish states whose forward did not
            for state in reversed(self.ctx.all_states):
                if state is not self and state.training_state is TrainingState.FORWARD:
                    state._finish_forward(output)
                    output = cast_tensors(output, state.mp_policy.output_dtype)
            self.ctx.iter_forward_root = None
        return cast_tensors(output, self.mp_policy.output_dtype)

    def _finish_forward(self, output: Any) -> None:
        """The group's post-forward; a hook on each output needing a gradient (the first to fire: pre-backward)."""
        if self.param_group is not None:
            self.param_group.post_forward()
        if torch.is_grad_enabled():
            for t in grad_tensors(output):
                t.register_hook(self._pre_backward)
        self.training_state = TrainingState.IDLE

    def _cast_inputs(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        dtype = self.mp_policy.param_dtype if self.mp_policy.cast_forward_inputs else None
        return cast_tensors(args, dtype), cast_tensors(kwargs, dtype)

    # ---------------------------------------------------------------- backward
    def _pre_backward(self, grad: torch.Tensor) -> torch.Tensor:
        self.training_state = TrainingState.PRE_BACKWARD
        if not self.ctx.callback_queued:
            self.ctx.callback_queued = True
            Variable._execution_engine.queue_callback(self._end_of_backward)
        if self.param_group is not None:
            self.param_group.pre_backward(implicit_prefetch=not self.backward_prefetch)
        for target in self.backward_prefetch:
            if target.param_group is not None:
                FSDPParamGroup.prefetch(target.param_group, TrainingState.PRE_BACKWARD)
        return grad

    def _end_of_backward(self) -> None:
        """torch's ``_root_post_backward_final_callback``: every group reduced and IDLE; after the step's last
        backward, the forward order and unused prefetches forgotten."""
        ctx = self.ctx
        ctx.iter_forward_root = None
        for state in ctx.all_states:
            group = state.param_group
            if group is not None:
                if group.training_state is not TrainingState.POST_BACKWARD:
                    group.post_backward()  # autograd never reached it (no input needed a gradient)
                group.training_state = TrainingState.IDLE
                if ctx.is_last_backward:
                    group.finalize_backward()
            state.training_state = TrainingState.IDLE
        if ctx.is_last_backward:
            ctx.post_forward_order.clear()
        ctx.callback_queued = False
