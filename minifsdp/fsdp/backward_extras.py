"""Two more backward hooks the public class adds to the core's (``core/backward.py``).

* **A frozen unit's reshard** (torch FSDP1's ``_post_backward_reshard_only_hook``).  A unit whose
  parameters do not require grad (LoRA-style runs) has no gradient leaf to hook, so the core
  would keep its full parameters gathered from its pre-backward to the end of the backward, and
  every frozen unit's with them.  A multi-grad hook on the unit's forward inputs fires once
  autograd is past the unit: it frees the parameters as a trainable unit's post-backward does.
* **Free before the concat** (ours, not torch's: a memory optimisation).  A unit's views of its
  full buffer come from one ``split``, so autograd gathers their gradients in one node,
  ``SplitWithSizesBackward0``, which runs once every node that read the parameters has run, and
  concatenates the gradients into the flat gradient (per-parameter gradients and the flat one
  both alive).  torch frees the parameters after that node; a pre-hook on it frees them before,
  so the concatenation no longer sits on top of them: one block less at the peak of ``bench fsdp``.
  Only for a sharded unit whose forward ran once since its last backward (with two forwards the
  first graph still reads the parameters after the second graph's split node), and not with
  ``use_orig_params`` (frozen, detached views are read outside that split's graph).  The numbers
  never change: no kernel reads them.
"""

from __future__ import annotations

import weakref

import torch
from torch.autograd.graph import register_multi_grad_hook
from torch.utils._pytree import tree_flatten

from minifsdp.fsdp.core.backward import frees_in_backward, prefetch_after
from minifsdp.fsdp.core.state import TrainingState

__all__ = ["register_reshard_only_hook", "post_backward_reshard", "register_free_before_concat"]


def register_reshard_only_hook(unit, args, kwargs) -> None:
    """Pre-forward of a frozen unit: arrange :func:`post_backward_reshard` for when autograd is past it.

    Registered at the first forward of an iteration, removed by the final callback.  No input that
    requires grad (a frozen embedding, first in the model): nothing to hook, the final callback frees it.
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
    if h.tracer is not None:
        h.tracer.close("backward", h.name)
    h.after_backward()
    if frees_in_backward(unit):
        h.reshard()
    prefetch_after(unit)


def register_free_before_concat(unit, again: bool) -> None:
    """Forward, once the views are made: free the parameters when the split's backward node is reached."""
    h = unit._handle
    unit._free_token = None  # a second forward (or no such node): the post-backward frees, as torch
    if again or h is None or h.use_orig_params or not h.sharded or not torch.is_grad_enabled() \
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
    if unit is not None and unit._free_token is token \
            and unit.training_state is TrainingState.PRE_BACKWARD and frees_in_backward(unit):
        unit._handle.reshard()
