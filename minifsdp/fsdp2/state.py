"""Chapter 5: the state of one ``fully_shard`` call and the hooks that drive its parameter group.

One :class:`FSDPState` per call, attached to every module of the call (one, or several for
``fully_shard([a, b])``), and one :class:`StateContext` shared by all states under a root, made at the root's
first forward (lazy init: the root is the first state whose forward runs; every state below it learns that it
is not one).  What runs when, on one rank::

    root pre-forward      lazy init once (adopt replaced local tensors, refuse meta, shared tied weights)
    pre-forward           all-gather and install the group; autograd identity on the inputs (post-backward)
    post-forward          reshard (as reshard_after_forward says); tensor hooks on the outputs (pre-backward)
    pre-backward          (first output gradient) all-gather again if resharded; prefetch the next group;
                          the first one queues the end-of-backward callback
    post-backward         (inputs' gradients) reduce-scatter the group's gradients, reshard
    end of backward       post-backward of groups autograd never reached; with set_is_last_backward(True),
                          finish the step (drop unused prefetches, forget the forward order)

Several modules in one call (torch's grouping, e.g. ``fully_shard([norm, head])``): the group is gathered at the
first module's pre-forward and resharded only after every module of the group ran (the set
``modules_to_run_forward``).  If the root's forward ends with some of them not run (a chunked loss calls
``model.head`` later, chunk by chunk), the root's post-forward completes those groups' post-forwards, and each later
standalone call gathers, and reduce-scatters in its backward, on its own, as torch's.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from torch.autograd import Variable

from minifsdp.fsdp.core.mixed_precision import cast_floating
from minifsdp.fsdp2.mixed_precision import MixedPrecisionPolicy
from minifsdp.fsdp2.nest import tensors_in
from minifsdp.fsdp2.param_group import CommContext, FSDPParamGroup, TrainingState

__all__ = ["FSDPState", "StateContext", "fsdp_state", "STATE_ATTR"]

STATE_ATTR = "_minifsdp_fsdp2_state"


def fsdp_state(module: nn.Module) -> "FSDPState | None":
    """The state ``fully_shard`` attached to ``module``, or None."""
    return module.__dict__.get(STATE_ATTR)


class StateContext:
    """What the root shares with every state below it, made at the root's first forward."""

    def __init__(self, states: list["FSDPState"]):
        self.all_states = states
        self.comm = CommContext()
        self.callback_queued = False
        self.iter_forward_root: FSDPState | None = None
        self.is_last_backward = True  # set_is_last_backward


class FSDPState:
    """Per ``fully_shard`` call: its modules, its group (None if it took no parameter), its hooks' logic."""

    def __init__(self, modules: tuple[nn.Module, ...], group: FSDPParamGroup | None,
                 mp_policy: MixedPrecisionPolicy, auto_reshard: bool):
        self.modules = modules
        self.param_group = group
        self.mp_policy = mp_policy
        self.auto_reshard = auto_reshard
        self.is_root: bool | None = None
        self.ctx = StateContext([self])  # replaced by the root's at lazy init
        self.training_state = TrainingState.IDLE
        self.forward_prefetch: list[FSDPState] = []  # set_modules_to_forward_prefetch
        self.backward_prefetch: list[FSDPState] = []  # set_modules_to_backward_prefetch
        self.modules_to_run_forward: set[nn.Module] = set()
        for module in modules:
            module.__dict__[STATE_ATTR] = self
        if len(modules) == 1:
            modules[0].register_forward_pre_hook(self.pre_forward, prepend=True, with_kwargs=True)
            modules[0].register_forward_hook(self.post_forward)
        else:
            for module in modules:
                module.register_forward_pre_hook(self._group_pre_forward, prepend=True, with_kwargs=True)
                module.register_forward_hook(self._group_post_forward(module), always_call=True)

    # ---------------------------------------------------------------- several modules, one group
    def _group_pre_forward(self, module: nn.Module, args: tuple, kwargs: dict):
        if not self.modules_to_run_forward:
            self.modules_to_run_forward.update(self.modules)
        return self.pre_forward(module, args, kwargs)

    def _group_post_forward(self, module: nn.Module):
        def hook(hook_module: nn.Module, args: tuple, output: Any) -> Any:
            if module in self.modules_to_run_forward:
                self.modules_to_run_forward.discard(module)
                if not self.modules_to_run_forward:  # the last module of the group ran
                    return self.post_forward(hook_module, args, output)
            return self._cast_output(output)
        return hook

    # ---------------------------------------------------------------- root
    def lazy_init(self) -> None:
        if self.is_root is not None:
            return
        if len(self.modules) > 1:
            raise RuntimeError(f"FSDP requires a single root module but got {list(self.modules)}")
        self.is_root = True
        states: list[FSDPState] = []
        for name, sub in self.modules[0].named_modules():
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
        for state in states:
            state.ctx = ctx
            if state.param_group is not None:
                state.param_group.comm_ctx = ctx.comm
        if self.auto_reshard and self.param_group is not None:
            self.param_group.reshard_after_forward = False  # the root keeps its parameters for backward
            self.param_group.post_forward_group = None
        self._init_fqns(states)
        self._validate_no_shared_params(states)
        for state in states:
            if state.param_group is not None:
                state.param_group.lazy_init()

    def _init_fqns(self, states: list["FSDPState"]) -> None:
        """Names for messages and records: each parameter's and each group's modules' (``"norm, output"``)."""
        root = self.modules[0]
        param_names = {id(p): n for n, p in root.named_parameters()}
        module_names = {id(m): n for n, m in root.named_modules(remove_duplicate=False)}
        for state in states:
            group = state.param_group
            if group is None:
                continue
            group.module_fqn = ", ".join(module_names.get(id(m), "?") for m in state.modules)
            for p in group.fsdp_params:
                p.fqn = param_names.get(id(p.sharded_param), p.users[0][1])

    def _validate_no_shared_params(self, states: list["FSDPState"]) -> None:
        """A weight tied across two calls was sharded twice (two copies that would drift apart): refuse it."""
        seen: dict[int, FSDPState] = {}
        names = {id(p): n for n, p in self.modules[0].named_parameters(remove_duplicate=False)}
        for state in states:
            for p in [] if state.param_group is None else state.param_group.fsdp_params:
                if seen.setdefault(id(p.orig_uid), state) is not state:
                    name = names.get(id(p.sharded_param), p.users[0][1])
                    raise ValueError(f"Parameter '{name}' is shared with a parameter already managed by another FSDP "
                                     "group. For shared/tied parameters, use fully_shard([module_a, module_b]) to "
                                     "place them in the same FSDP group.")

    # ---------------------------------------------------------------- hooks
    def pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if self.training_state is TrainingState.PRE_BACKWARD:  # a recomputation inside backward
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
        if first_in_pass:  # explicit forward prefetch: gather the listed modules now, before they run
            for target in self.forward_prefetch:
                if target.param_group is not None:
                    FSDPParamGroup.prefetch(target.param_group, TrainingState.FORWARD)
        return args, kwargs

    def post_forward(self, module: nn.Module | None, args: tuple, output: Any) -> Any:
        if self.training_state is TrainingState.PRE_BACKWARD:
            return self._cast_output(output)
        if self.param_group is not None:
            self.param_group.post_forward()
        self._register_pre_backward(output)
        self.training_state = TrainingState.IDLE
        if self.ctx.iter_forward_root is self:
            output = self._complete_unfinished_groups(output)
            self.ctx.iter_forward_root = None
        return self._cast_output(output)

    def _complete_unfinished_groups(self, output: Any) -> Any:
        """The root's forward ended: finish the post-forward of every group whose modules did not all run."""
        for state in reversed(self.ctx.all_states):
            if state is self or not state.modules_to_run_forward:
                continue
            if state.param_group is not None:
                state.param_group.post_forward()
            state._register_pre_backward(output)
            state.training_state = TrainingState.IDLE
            output = state._cast_output(output)
            state.modules_to_run_forward.clear()
        return output

    def _register_pre_backward(self, output: Any) -> None:
        if torch.is_grad_enabled():
            for t in tensors_in(output):  # dataclasses included (see minifsdp.fsdp2.nest)
                if t.requires_grad:
                    t.register_hook(self._pre_backward)

    def _cast_inputs(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if not (self.mp_policy.cast_forward_inputs and self.mp_policy.param_dtype):
            return args, kwargs
        return cast_floating(args, self.mp_policy.param_dtype), cast_floating(kwargs, self.mp_policy.param_dtype)

    def _cast_output(self, output: Any) -> Any:
        return cast_floating(output, self.mp_policy.output_dtype)

    def _pre_backward(self, grad: torch.Tensor) -> torch.Tensor:
        self.training_state = TrainingState.PRE_BACKWARD
        ctx = self.ctx
        if not ctx.callback_queued:
            ctx.callback_queued = True
            Variable._execution_engine.queue_callback(self._end_of_backward)
        if self.param_group is not None:
            self.param_group.pre_backward(implicit_prefetch=not self.backward_prefetch)
        for target in self.backward_prefetch:  # explicit: these instead of the previous group
            if target.param_group is not None:
                FSDPParamGroup.prefetch(target.param_group, TrainingState.PRE_BACKWARD)
        return grad

    def _end_of_backward(self) -> None:
        ctx = self.ctx
        ctx.iter_forward_root = None
        for state in ctx.all_states:
            state.modules_to_run_forward.clear()
            group = state.param_group
            if group is not None:
                if group.training_state is not TrainingState.POST_BACKWARD:
                    group.post_backward()  # a group autograd never reached (inputs without gradients)
                group.training_state = TrainingState.IDLE
                if ctx.is_last_backward:
                    group.finalize_backward()
            state.training_state = TrainingState.IDLE
        if ctx.is_last_backward:
            ctx.comm.post_forward_order.clear()
        ctx.callback_queued = False

    def reset_iter_state(self) -> None:
        """After an exception in forward or backward: every state and group back to IDLE and sharded."""
        if self.is_root is False:
            raise RuntimeError("reset_iter_state must be called on the root FSDP module")
        ctx = self.ctx
        ctx.comm.post_forward_order.clear()
        for state in ctx.all_states:
            state.modules_to_run_forward.clear()
            state.training_state = TrainingState.IDLE
            if state.param_group is not None:
                state.param_group.reset_iter_state()
        ctx.iter_forward_root = None
        ctx.callback_queued = False
