"""The backward of an FSDP unit: the hooks autograd calls, in the order it calls them.

    pre_backward            autograd reached one of the unit's outputs: gather its parameters again
                            (the root also queues the final callback, once per backward)
    post_backward           autograd summed the unit's full gradient (a hook on its leaf):
                            free the parameters, prefetch (BACKWARD_POST), start the reduction
    post_backward_reshard   a *frozen* unit (no gradient, so no such hook): autograd has computed
                            the gradients of its inputs, so it is past the unit: free the parameters
    final_callback          the end of the whole backward (the root's): finish every reduction,
                            free what is left, every unit back to IDLE
    free_before_concat      (ours, not torch's) autograd has every parameter's gradient of the unit and
                            is about to concatenate them into the flat gradient: free the parameters now

Each is torch FSDP1's (``torch/distributed/fsdp/_runtime_utils.py``): ``_pre_backward_hook``,
``_post_backward_hook``, ``_post_backward_reshard_only_hook``, ``_post_backward_final_callback``.

Note (frozen units, LoRA-style runs): a unit whose parameters do not require grad has no
gradient leaf to hook.  Without :func:`register_reshard_only_hook` its full parameters
would stay gathered from its pre-backward to the end of the backward, and every frozen
unit's with them; with it, each is freed as soon as autograd is past it, as a trainable
unit is, and ``limit_all_gathers`` does not stop prefetching for the rest of the backward.
"""

from __future__ import annotations

import functools
import weakref

import torch
from torch.autograd.graph import register_multi_grad_hook
from torch.utils._pytree import tree_flatten

from minifsdp.fsdp.prefetch import BackwardPrefetch, prefetch
from minifsdp.fsdp.sharding import RESHARD_AFTER_FORWARD
from minifsdp.fsdp.state import TrainingState

__all__ = ["pre_backward", "post_backward", "register_reshard_only_hook", "post_backward_reshard",
           "final_callback", "frees_in_backward", "register_free_before_concat"]


def frees_in_backward(unit) -> bool:
    """torch's ``_should_free_in_backward``: under no_sync, SHARD_GRAD_OP keeps its full parameters for the
    next micro-batch; NO_SHARD's low-precision copy is always freed (torch's ``post_reshard``)."""
    h = unit._handle
    return h.casts_unsharded or (h.sharded and (unit._sync_gradients
                                                or unit.sharding_strategy in RESHARD_AFTER_FORWARD))


def _prefetch_after(unit) -> None:
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
        if h.use_orig_params:  # a recompute (activation_checkpointing.py) reads the parameters again
            h.use_unsharded_views()
        h.prepare_gradient()
        if unit._tracer is not None:
            unit._tracer.open("backward", h.name)
    return None


def post_backward(unit) -> None:
    """Autograd has summed ``unit``'s full gradient: free its parameters, prefetch, start its reduction."""
    h, step = unit._handle, unit._root._root_step
    unit.training_state = TrainingState.POST_BACKWARD
    if unit._tracer is not None:
        unit._tracer.close("backward", h.name)
    if h.use_orig_params:
        h.use_sharded_views()
    # torch's order (_post_backward_hook): _post_backward_reshard (free the parameters, then the
    # BACKWARD_POST prefetch) before _reduce_grad, so the next unit's all-gather is issued first.
    # Freeing the parameters leaves the full gradient (a tensor of its own) in place.
    if frees_in_backward(unit):
        h.reshard()
    _prefetch_after(unit)
    if not unit._sync_gradients:
        h.expose_unsharded_grad()  # where zero_grad() can reach it, as in torch
        return
    # At most one reduction in flight: finish the previous unit's (it had this unit's whole
    # backward to complete) so its full gradient is freed now, not at the end of the backward.
    for other in step.units:
        if other is not unit and other._handle is not None and other._handle.pending:
            other._handle.finish_reduce()
    h.start_reduce()
    if h.sharded and h.flat_param.device.type == "cpu":
        # torch FSDP1 on CPU reduce-scatters synchronously in this hook: a unit's full gradient never
        # outlives it.  Keeping one reduction in flight (torch's GPU way, on a stream) would hold a whole
        # unit's gradient through the next unit's backward: +1 block at the peak (bench TinyGPT: 4%).
        h.finish_reduce()


def register_free_before_concat(unit, awaiting: bool) -> None:
    """Forward (after the views are made): free the unit's gathered parameters one step earlier than torch.

    The views of the full buffer come from one ``split`` (``flat_param.unflatten``), so autograd
    gathers the unit's parameter gradients in one node, ``SplitWithSizesBackward0``, which runs
    once *all* of them are computed, i.e. once every node that uses the parameters has run; it
    then concatenates them into the flat gradient (the per-parameter gradients and the flat one
    both alive: two units' worth).  torch frees the parameters after that (post-backward, on the
    leaf's AccumulateGrad, which reads no data either); a pre-hook on that node frees them
    before, so the concatenation no longer sits on top of them (bench fsdp, 19M TinyGPT: this is
    the peak; one block less there).

    Note (when not): only for a unit whose forward ran once since its last backward (``awaiting``
    False): with two forwards, the first graph's nodes still need the parameters after the
    second graph's split node; only sharded units without ``use_orig_params`` (whose frozen,
    detached views could be read by a node outside that split's graph).  Otherwise the
    post-backward frees them, as before.  The numbers never change: no kernel reads them.
    """
    h = unit._handle
    unit._free_token = None  # a second forward (or none of this kind): post_backward frees, as torch
    if awaiting or h is None or h.use_orig_params or not h.sharded or not torch.is_grad_enabled() \
            or not h.unsharded.requires_grad:
        return
    slot = h.layout.slots[0]
    node = getattr(slot.module.__dict__.get(slot.name), "grad_fn", None)
    while node is not None and node.name() != "SplitWithSizesBackward0":  # the view's ViewBackward0, then split
        node = node.next_functions[0][0] if node.next_functions else None
    if node is None:
        return
    token = unit._free_token = object()
    ref = weakref.ref(unit)  # the hook lives in C++ with the graph: no reference that keeps the model alive
    node.register_prehook(lambda _grads: _free_before_concat(ref(), token))


def _free_before_concat(unit, token) -> None:
    if unit is not None and unit.__dict__.get("_free_token") is token \
            and unit.training_state is TrainingState.PRE_BACKWARD and frees_in_backward(unit):
        unit._handle.reshard()


def register_reshard_only_hook(unit, args, kwargs) -> None:
    """Pre-forward of a frozen unit: arrange :func:`post_backward_reshard` for when autograd is past it.

    As torch (``_register_post_backward_reshard_only_hook``): a multi-grad hook on the
    forward inputs that require grad fires once all their gradients are computed, i.e.
    after the unit's whole backward.  Registered at the first forward of an iteration,
    removed by the final callback.  No such input (a frozen embedding, first in the
    model): nothing to hook, the final callback frees it, as in torch.
    """
    if unit._reshard_only_hook is not None or not torch.is_grad_enabled():
        return
    inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor) and t.requires_grad]
    if inputs:
        unit._reshard_only_hook = register_multi_grad_hook(inputs, lambda _grads: post_backward_reshard(unit))


def post_backward_reshard(unit) -> None:
    """A frozen unit's post-backward: nothing to reduce; free its parameters, prefetch (BACKWARD_POST)."""
    h = unit._handle
    unit.training_state = TrainingState.POST_BACKWARD
    if unit._tracer is not None:
        unit._tracer.close("backward", h.name)
    if h.use_orig_params:
        h.use_sharded_views()
    if frees_in_backward(unit):
        h.reshard()
    _prefetch_after(unit)


def final_callback(root) -> None:
    """Runs once at the end of the backward: finish every reduction, every unit back to IDLE."""
    step = root._root_step
    for unit in step.units:
        unit.training_state = TrainingState.IDLE
        if unit._reshard_only_hook is not None:
            unit._reshard_only_hook.remove()
            unit._reshard_only_hook = None
        h = unit._handle
        if h is None:
            continue
        h.finish_reduce()
        if frees_in_backward(unit):
            h.reshard()
    step.final_callback_queued = False
    step.versions_at_forward = None
    step.order.end_iteration()
