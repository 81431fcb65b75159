"""Chapter 5: ``FSDPModule``, the methods a sharded module gains, and ``register_fsdp_forward_method``.

``fully_shard`` changes a module's class to ``FSDP<Orig>`` with :class:`FSDPModule` first in its bases, as torch
does, so these methods exist on the module itself.  Each one only changes a setting of the module's state, its
parameter group, or one of the group's plugins (``recurse=True``: on every sharded module below it too); the core's
hooks (:mod:`minifsdp.fsdp2.core`) and the plugins read them.  The names, arguments and defaults are torch's:

    unshard / reshard                      gather now (optionally returning a handle) / free the full parameters
    set_requires_gradient_sync(False)      accumulate full gradients, no reduce-scatter (nor HSDP all-reduce)
    set_requires_all_reduce(False)         HSDP: reduce-scatter each micro-batch, all-reduce only when allowed
    set_is_last_backward(False)            this backward is not the step's last: keep the forward order
    set_reshard_after_forward / _backward  when to free the full parameters
    set_modules_to_forward/backward_prefetch   explicit prefetching
    set_gradient_divide_factor(f)          divide gradients by f instead of the data-parallel size
    set_force_sum_reduction_for_comms      collectives sum only; the divides happen apart
    set_all_reduce_hook(hook)              called on each group's reduced shard (e.g. a custom all-reduce)
    set_unshard_in_backward(False)         the group's parameters are not needed in backward (embeddings)
    reset_iter_state()                     recover after an exception mid-iteration

Settings that pick CUDA streams, events or buffers in torch (``set_post_optim_event``,
``set_reduce_scatter_max_input_buffers``, ``_set_unshard_async_op``) are accepted and validated as torch's; with
synchronous collectives on one thread there is nothing for them to change.  Not built: custom all-gather and
reduce-scatter objects (``set_custom_all_gather`` / ``set_custom_reduce_scatter``: torch's hooks to replace the
collective itself, e.g. by one over symmetric memory).  The all-gather *extensions* (a parameter's local tensor
choosing what is gathered and how the full weight is rebuilt) are built: :mod:`minifsdp.fsdp2.extensions`.

:class:`GradientSync` is the plugin behind ``set_requires_gradient_sync(False)`` (gradient accumulation): it
plugs in before the core's reduce-scatter (``before_reduce``, :mod:`minifsdp.fsdp2.core.plugin`), takes the full
gradients out of the reduction and keeps them, on the unsharded parameter (where autograd adds the next backward's
to them) or, under a ``reduce_dtype``, in an accumulator of that dtype (as torch's, so micro-batches add up in the
higher precision); the backward that syncs reduces the sum.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch
import torch.nn as nn

from minifsdp.fsdp2.core import FSDPParam, FSDPParamGroup, FSDPState, Plugin, TrainingState, fsdp_state
from minifsdp.fsdp2.hsdp import AllReduceHook, Replicate
from minifsdp.fsdp2.reshard import ReshardToGroup

__all__ = ["FSDPModule", "UnshardHandle", "register_fsdp_forward_method", "GradientSync"]


class GradientSync(Plugin):
    """The plugin for ``set_requires_gradient_sync``: backwards that keep their full gradients for a later one."""

    def __init__(self):
        self.requires_gradient_sync = True
        self.accumulated: dict[FSDPParam, torch.Tensor] = {}  # full gradients in reduce_dtype, until a sync

    def before_reduce(self, group, params: list, grads: list[torch.Tensor]) -> None:
        if not self.requires_gradient_sync:  # keep them all; nothing is reduced this time
            for p, g in zip(params, grads, strict=True):
                if p in self.accumulated:
                    self.accumulated[p] += g
                elif p.reduce_dtype is not None and g.dtype != p.reduce_dtype:
                    self.accumulated[p] = g.to(p.reduce_dtype)
                else:
                    p.unsharded_param.grad = g  # autograd adds the next backward's gradient to it
            params.clear()
            grads.clear()
        elif self.accumulated:  # this backward syncs: reduce the sums, in the group's order
            new = dict(zip(params, grads, strict=True))
            params.clear()
            grads.clear()
            for p in group.fsdp_params:
                g = new.pop(p, None)
                if p in self.accumulated:
                    total = self.accumulated.pop(p)
                    if g is not None:
                        total += g
                    g = total
                if g is not None:
                    params.append(p)
                    grads.append(g)


class UnshardHandle:
    """What ``unshard(async_op=True)`` returns: the all-gather ran; ``wait()`` copies out and installs the
    full parameters (torch's handle waits for the collective first; here it already finished)."""

    def __init__(self, group: FSDPParamGroup | None):
        self.group = group

    def wait(self) -> None:
        if self.group is not None:
            self.group.wait_for_unshard()
            self.group = None


def _groups(module: nn.Module, recurse: bool) -> list[FSDPParamGroup]:
    modules = module.modules() if recurse else [module]
    seen, out = set(), []
    for m in modules:
        state = fsdp_state(m) if isinstance(m, FSDPModule) else None
        if state is not None and state.param_group is not None and id(state) not in seen:
            seen.add(id(state))
            out.append(state.param_group)
    return out


def _set(module: nn.Module, recurse: bool, **flags: Any) -> None:
    for group in _groups(module, recurse):
        for name, value in flags.items():
            setattr(group, name, value)


def _plugins(module: nn.Module, recurse: bool, cls: type) -> list:
    """The plugins of type ``cls`` of the groups of ``module`` (and below it, with ``recurse``)."""
    return [p for group in _groups(module, recurse) for p in group.plugins if isinstance(p, cls)]


class FSDPModule:
    """Mixed into a sharded module's class (``FSDP<Orig>``): the methods torch's ``FSDPModule`` offers."""

    _orig_cls_mro_index = 2

    def __new__(cls, *args, **kwargs):
        """Constructing an ``FSDP<Orig>`` (e.g. slicing a sharded ``nn.Sequential``) makes a plain ``Orig``."""
        orig_cls = cls.__mro__[cls._orig_cls_mro_index]
        self = orig_cls.__new__(orig_cls, *args, **kwargs)
        self.__init__(*args, **kwargs)
        return self

    def __deepcopy__(self, memo):
        raise AssertionError("FSDP does not support deepcopy. Please use state dict for serialization.")

    def _get_fsdp_state(self) -> FSDPState:
        return fsdp_state(self)

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """All-gather this module's parameters now (they stay gathered until :meth:`reshard`).  The collective is
        synchronous here; with ``async_op=True`` the returned handle's ``wait()`` installs them, as torch's."""
        group = fsdp_state(self).param_group
        if group is not None:
            group.lazy_init()
            group.unshard()
        handle = UnshardHandle(group)
        if async_op:
            return handle
        handle.wait()
        return None

    def reshard(self) -> None:
        """Free this module's full parameters; the modules hold the sharded ones again."""
        group = fsdp_state(self).param_group
        if group is not None:
            group.reshard()

    def reset_iter_state(self) -> None:
        """After an exception in forward or backward (torch's ``_reset_iter_state``), on the root: every state and
        group back to IDLE and sharded, pending gathers, the forward order and HSDP's partial sums dropped."""
        state = fsdp_state(self)
        if state.is_root is False:
            raise RuntimeError("reset_iter_state must be called on the root FSDP module")
        ctx = state.ctx
        ctx.post_forward_order.clear()
        for s in ctx.all_states:
            s.training_state = TrainingState.IDLE
            if s.param_group is not None:  # pending gathers and the order forgotten, sharded again
                s.param_group.finalize_backward()
                s.param_group.training_state = TrainingState.IDLE
                s.param_group.to_sharded()
        ctx.iter_forward_root = None
        ctx.callback_queued = False
        for plugin in _plugins(self, True, Replicate):
            plugin.partial = None

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        fsdp_state(self).ctx.is_last_backward = is_last_backward

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """False: backward keeps full gradients on each rank unreduced (accumulation); True: reduce-scatter."""
        for plugin in _plugins(self, recurse, GradientSync):
            plugin.requires_gradient_sync = requires_gradient_sync
        self.set_requires_all_reduce(requires_gradient_sync, recurse=recurse)

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        for plugin in _plugins(self, recurse, Replicate):
            plugin.all_reduce_grads = requires_all_reduce

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        if not isinstance(reshard_after_forward, bool):
            raise ValueError(f"reshard_after_forward should be a bool, got {type(reshard_after_forward)}")
        for m in self.modules() if recurse else [self]:
            state = fsdp_state(m) if isinstance(m, FSDPModule) else None
            if state is not None:
                state.auto_reshard = False
        _set(self, recurse, reshard_after_forward=reshard_after_forward)
        for group in _groups(self, recurse):  # a bool replaces an int's smaller group
            group.plugins = [p for p in group.plugins if not isinstance(p, ReshardToGroup)]

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        _set(self, recurse, reshard_after_backward=reshard_after_backward)

    def set_modules_to_forward_prefetch(self, modules: list[nn.Module]) -> None:
        """In this module's pre-forward, after its own all-gather, all-gather these modules' parameters too."""
        fsdp_state(self).forward_prefetch = [fsdp_state(m) for m in _all_fsdp(modules)]

    def set_modules_to_backward_prefetch(self, modules: list[nn.Module]) -> None:
        """In this module's pre-backward, all-gather these modules' parameters (replaces the implicit
        prefetch of the module whose forward ran just before this one)."""
        fsdp_state(self).backward_prefetch = [fsdp_state(m) for m in _all_fsdp(modules)]

    def set_gradient_divide_factor(self, factor: float) -> None:
        """This module's group only (as torch's: not recursive)."""
        _set(self, False, gradient_divide_factor=factor)

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:  # torch's older name
        self.set_gradient_divide_factor(factor)

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        _set(self, False, force_sum_reduction_for_comms=enable)

    def set_all_reduce_hook(self, hook: Callable[[torch.Tensor], None], *, stream=None) -> None:
        group = fsdp_state(self).param_group
        if group is None:
            return
        if stream is not None and _plugins(self, False, Replicate):
            raise ValueError("stream cannot be set when using native HSDP")
        group.plugins = [p for p in group.plugins if not isinstance(p, AllReduceHook)] + [AllReduceHook(hook)]

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        _set(self, False, unshard_in_backward=unshard_in_backward)

    def set_post_optim_event(self, event) -> None:
        """torch's compute stream waits on ``event`` before the next all-gather; one thread needs no wait."""

    def set_reduce_scatter_max_input_buffers(self, max_input_buffers: int, *, recurse: bool = True) -> None:
        """torch keeps that many reduce-scatter inputs in flight on its streams; here each is freed at once."""
        if isinstance(max_input_buffers, bool) or not isinstance(max_input_buffers, int):
            raise TypeError(f"max_input_buffers must be an int, got {type(max_input_buffers).__name__}")
        if max_input_buffers < 1:
            raise ValueError(f"max_input_buffers must be >= 1, got {max_input_buffers}")

    def _set_unshard_async_op(self, async_op: bool) -> None:
        """torch's choice of stream for the all-gather; the collectives here are synchronous on one thread."""

    def set_custom_all_gather(self, comm) -> None:
        raise NotImplementedError("minifsdp's fully_shard has no custom all-gather object (it always calls torch's "
                                  "all-gather); for fsdp_pre/post_all_gather extensions none is needed")

    def set_custom_reduce_scatter(self, comm) -> None:
        raise NotImplementedError("minifsdp's fully_shard has no custom reduce-scatter object (it always calls "
                                  "torch's reduce-scatter)")


def _all_fsdp(modules) -> list[nn.Module]:
    for m in modules:
        if not isinstance(m, FSDPModule):
            raise ValueError(f"Expects FSDPModule but got {type(m)}: {m}")
    return list(modules)


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Make ``module.<method_name>`` run FSDP's pre- and post-forward around it, as ``forward`` does (e.g. a
    vision tower's ``forward_features`` called by its parent).  A no-op on a module ``fully_shard`` did not take."""
    if not isinstance(module, FSDPModule):
        return
    if not hasattr(module, method_name):
        raise ValueError(f"{type(module)} does not have a method {method_name}")
    orig = getattr(module, method_name)

    @functools.wraps(orig)
    def wrapped(self, *args, **kwargs):
        state = fsdp_state(self)
        args, kwargs = state.pre_forward(self, args, kwargs)
        return state.post_forward(self, args, orig(*args, **kwargs))

    setattr(module, method_name, wrapped.__get__(module, type(module)))
