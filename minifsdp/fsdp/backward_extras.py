"""Three more backward hooks the public class adds to the core's (``core/fsdp.py``): :class:`BackwardExtras`.

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
  ``use_orig_params`` (its views are the user's tensors, which code may read outside that split's graph).  The numbers
  never change: no kernel reads them.
* **Gather again for a reentrant checkpoint's second call** (ours, not torch's: torch is wrong here).  A
  reentrant checkpoint (``CheckpointImpl.REENTRANT``) recomputes its block inside the backward and runs that
  block's backward as a backward of its own, so the unit's post-backward runs there, once per call: after the
  last call's, the parameters are freed and the gradient reduced, and an earlier call of the same unit (a
  module called twice) recomputes from freed storage.  torch FSDP1 runs the pre-backward once per backward and
  fails (``setStorage ... storage of size 0``), or, under ``MixedPrecision`` or with ``use_orig_params`` on
  ``NO_SHARD``, leaves that unit without its gradient or with an unreduced part of it.  A hook on each call's
  outputs tells which call autograd reached: one not reached before, arriving after the post-backward, runs
  the pre-backward again (gather, the backward's views); its post-backward reduces its part, added to the
  first (``tests/test_fsdp_checkpointing_parity.py``).
"""

from __future__ import annotations

import weakref

import torch
from torch.autograd.graph import register_multi_grad_hook
from torch.distributed.utils import _apply_to_tensors
from torch.utils._pytree import tree_flatten

from minifsdp.fsdp.core.extension import Extension
from minifsdp.fsdp.core.fsdp import TrainingState

__all__ = ["BackwardExtras"]


class BackwardExtras(Extension):
    """The three hooks above, for one unit: registered in its forward (``before_forward``, ``after_unshard``,
    ``after_forward``), the first removed by the final callback (``after_backward``).  ``free_before_concat``:
    the second one too."""

    def __init__(self, free_before_concat: bool = True):
        self.free_before_concat = free_before_concat
        self.reshard_only_hook = None  # a frozen unit's post-backward, on its inputs
        self.free_token = None  # the free-before-concat hook of this iteration
        self.again = False  # this forward runs again before the previous one's backward
        self.calls, self.reached = 0, set()  # forwards with grad since the last backward; those autograd reached

    def before_forward(self, unit, args, kwargs) -> None:
        """A frozen unit: arrange its post-backward for when autograd is past it (once per iteration).
        No input that requires grad (a frozen embedding, first in the model): nothing to hook, the final
        callback frees it."""
        self.again = unit.training_state is TrainingState.AWAITING_BACKWARD
        if self.again:  # a forward prefetch made this forward's views already (core/prefetch.py, Note (views)),
            self.free_token = None  # and hooked their split node before the unit knew: undo it
        h = unit._handle
        if h is None or h.unsharded.requires_grad or self.reshard_only_hook is not None \
                or not torch.is_grad_enabled():
            return
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        if inputs:
            ref = weakref.ref(unit)
            self.reshard_only_hook = register_multi_grad_hook(inputs, lambda _grads: _post_backward_reshard(ref()))

    def after_unshard(self, unit) -> None:
        """Forward, once the views are made: free the parameters when the split's backward node is reached."""
        if unit.training_state is not TrainingState.FORWARD:
            return
        h = unit._handle
        self.free_token = None  # a second forward (or no such node): the post-backward frees, as torch
        if self.again or not self.free_before_concat or not h.sharded or not torch.is_grad_enabled() \
                or not h.unsharded.requires_grad:
            return
        slot = h.layout.slots[0]
        node = getattr(slot.module.__dict__.get(slot.name), "grad_fn", None)
        while node is not None and node.name() != "SplitWithSizesBackward0":  # the view's ViewBackward0, then split
            node = node.next_functions[0][0] if node.next_functions else None
        if node is None:
            return
        token = self.free_token = object()
        ref = weakref.ref(unit)  # the hook lives in C++ with the graph: no reference that keeps the model alive
        node.register_prehook(lambda _grads: self._free_before_concat(ref(), token))

    def _free_before_concat(self, unit, token) -> None:
        if unit is not None and self.free_token is token \
                and unit.training_state is TrainingState.PRE_BACKWARD and unit._should_free_in_backward():
            unit._handle.end_use(free=True)

    def after_forward(self, unit, output) -> None:
        """Tag this call's outputs (after the core's pre-backward hooks on them, so these run after those)."""
        if unit._handle is None or not torch.is_grad_enabled():
            return
        self.calls += 1
        call, ref = self.calls, weakref.ref(unit)

        def tag(t):  # hooked inside the walk: a list of the outputs would live as long as torch's walk (a
            if t.requires_grad:  # closure cycle only the garbage collector frees), past the backward
                t.register_hook(lambda _grad: self._reached(ref(), call))
            return t

        _apply_to_tensors(tag, output)

    def _reached(self, unit, call: int) -> None:
        if unit is None or call in self.reached:
            return
        self.reached.add(call)
        if unit.training_state is TrainingState.POST_BACKWARD:  # a nested backward reduced a later call's part
            unit.training_state = TrainingState.AWAITING_BACKWARD
            unit._pre_backward_hook(None)  # gather again for this call's recompute

    def after_backward(self, unit) -> None:
        self.again = False  # (the next forward's prefetch reads it before that forward's before_forward)
        self.calls, self.reached = 0, set()
        if self.reshard_only_hook is not None:
            self.reshard_only_hook.remove()
            self.reshard_only_hook = None


def _post_backward_reshard(unit) -> None:
    """A frozen unit's post-backward (torch's ``_post_backward_reshard_only_hook``): nothing to reduce; free its
    parameters and prefetch (BACKWARD_POST), as the core's post-backward does first."""
    if unit is not None:
        unit.training_state = TrainingState.POST_BACKWARD
        unit._post_backward_reshard()
