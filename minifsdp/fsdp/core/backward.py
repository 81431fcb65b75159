"""The backward of an FSDP unit: the hooks autograd calls, in the order it calls them.

    pre_backward     autograd reached one of the unit's outputs: gather its parameters again
                     (the root also queues the final callback, once per backward)
    post_backward    autograd summed the unit's full gradient (a hook on its leaf):
                     free the parameters, prefetch (BACKWARD_POST), start the reduction
    final_callback   the end of the whole backward (the root's): finish every reduction,
                     free what is left, every unit back to IDLE

Each is torch FSDP1's (``torch/distributed/fsdp/_runtime_utils.py``): ``_pre_backward_hook``,
``_post_backward_hook``, ``_post_backward_final_callback``.

    backward of   [root tail] -> [block 1] -> [block 0] -> [root head]
    hooks                  pre b1 (AG b1, AG b0 prefetched) .. post b1 (free, RS b1)
                                            pre b0 .. post b0 (free, RS b0) ... final callback
"""

import functools

import torch

from minifsdp.fsdp.core.prefetch import BackwardPrefetch, prefetch
from minifsdp.fsdp.core.state import TrainingState
from minifsdp.fsdp.core.strategy import RESHARD_AFTER_FORWARD


def frees_in_backward(unit) -> bool:
    """torch's ``_should_free_in_backward``: under no_sync, SHARD_GRAD_OP keeps its full parameters for the
    next micro-batch; NO_SHARD's low-precision copy is always freed."""
    h = unit._handle
    return h.casts_unsharded or (h.sharded and (unit._sync_gradients
                                                or unit.sharding_strategy in RESHARD_AFTER_FORWARD))


def prefetch_after(unit) -> None:
    """BACKWARD_POST: once ``unit`` is freed, start the all-gather of the unit the backward needs next."""
    root = unit._root
    if root.backward_prefetch is BackwardPrefetch.BACKWARD_POST:
        step = root._root_step
        prefetch(step.order.next_in_backward(unit), step.units, root.limit_all_gathers, in_backward=True)


def pre_backward(unit, grad):
    """Autograd reached one of ``unit``'s outputs: gather its parameters again (once per backward)."""
    root = unit._root
    step = root._root_step
    if not step.final_callback_queued:
        step.final_callback_queued = True
        torch.autograd.Variable._execution_engine.queue_callback(functools.partial(final_callback, root))
    if unit.training_state in (TrainingState.PRE_BACKWARD, TrainingState.POST_BACKWARD):
        return None  # another of its outputs already brought it here
    unit.training_state = TrainingState.PRE_BACKWARD
    h = unit._handle
    if h is not None:
        h.unshard()
        if root.backward_prefetch is BackwardPrefetch.BACKWARD_PRE:
            prefetch(step.order.next_in_backward(unit), step.units, root.limit_all_gathers, in_backward=True)
        h.before_backward()
        h.gradient.prepare()
        if h.tracer is not None:
            h.tracer.open("backward", h.name)
    return None


def post_backward(unit) -> None:
    """Autograd has summed ``unit``'s full gradient: free its parameters, prefetch, start its reduction."""
    h, step = unit._handle, unit._root._root_step
    unit.training_state = TrainingState.POST_BACKWARD
    if h.tracer is not None:
        h.tracer.close("backward", h.name)
    h.after_backward()
    # torch's order: free the parameters, then the BACKWARD_POST prefetch, then reduce, so the next
    # unit's all-gather is issued first.  Freeing them leaves the full gradient (its own tensor) in place.
    if frees_in_backward(unit):
        h.reshard()
    prefetch_after(unit)
    if not unit._sync_gradients:
        h.gradient.keep_unsharded()  # where zero_grad() can reach it, as in torch
        return
    # At most one reduction in flight: finish the previous unit's (it had this unit's whole backward
    # to complete), so its full gradient is freed now, not at the end of the backward.
    for other in step.units:
        if other is not unit and other._handle is not None:
            other._handle.gradient.finish_reduce()
    h.gradient.start_reduce()
    if h.sharded and h.flat_param.device.type == "cpu":
        # torch FSDP1 on CPU reduce-scatters synchronously in this hook: a unit's full gradient never
        # outlives it (one in flight would hold it through the next unit's backward: +1 block at the peak).
        h.gradient.finish_reduce()


def final_callback(root) -> None:
    """Runs once at the end of the backward: finish every reduction, every unit back to IDLE."""
    step = root._root_step
    for unit in step.units:
        unit._finish_backward()
    step.final_callback_queued = False
    step.order.end_iteration()
