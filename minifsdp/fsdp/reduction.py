"""A unit's gradient, from autograd's full sum to the optimizer's shard: the reduction half of a handle.

    post-backward   full grad (compute dtype) --cast--> reduce_dtype --/f--> reduce-scatter   (started)
    later           wait --HYBRID: all-reduce across replicas--> /(N/f) --cast--> fp32
                    --> added into flat_param.grad (or into the shard kept from an earlier backward)

``later`` is the next unit's post-backward, or the root's final callback for the
last unit (``fully_sharded.py``): at most one reduction in flight; on CPU the unit's own
post-backward, as torch FSDP1 on CPU (``backward.py``).  NO_SHARD
all-reduces the whole gradient instead, with the same casts and divide factors
(``sharding.py``), as torch FSDP1's ``_reduce_grad_no_shard``.

Where a unit's gradient lives (torch FSDP1's places, so ``zero_grad`` reaches it):

    strategy                     autograd sums into         the optimizer reads
    sharded                      unsharded.grad (full)      flat_param.grad (shard, fp32)
    NO_SHARD                     flat_param.grad            flat_param.grad (all-reduced in place)
    NO_SHARD + param_dtype       unsharded.grad (bf16)      flat_param.grad (fp32, a cast of the all-reduce)

``MixedPrecision(keep_low_precision_grads=True)``: the optimizer's gradient stays in
``param_dtype`` (``grad_dtype``), as torch's; ``set_grad`` lets a gradient's dtype differ.

Note (NO_SHARD with parameter mixed precision): torch's flat parameter *is* the
low-precision leaf during the forward and backward (its ``.data`` swapped to the
cast copy), so its ``AccumulateGrad`` adds the bf16 gradient ``g`` straight into
``flat_param.grad`` (``G = g``, or ``G += g`` in G's dtype).  Our leaf is a
separate ``unsharded`` tensor; at the post-backward we move its gradient into
``flat_param.grad`` by the same rule (:meth:`GradientReduction._take_cast_grad`),
then cast to ``reduce_dtype``, divide, all-reduce, divide, cast to fp32.  The
numbers and their order are torch's, ``no_sync`` accumulation included.

This class is the gradient half of :class:`~minifsdp.fsdp.handle.FlatParamHandle`
(a mixin: it reads the handle's tensors, layout, groups and dtypes, set up there).
"""

from __future__ import annotations

import torch

from minifsdp.fsdp.events import span
from minifsdp.fsdp.flat_param import unflatten
from minifsdp.fsdp.sharding import finish_reduced_shard, prepare_for_reduce_scatter

__all__ = ["GradientReduction", "set_grad"]


def set_grad(param: torch.nn.Parameter, grad: torch.Tensor) -> None:
    """``param.grad = grad`` although their shapes or dtypes differ (torch FSDP1 does the same): swap ``.data``."""
    data = param.data
    param.data = grad
    param.grad = grad
    param.data = data


class GradientReduction:
    """Prepare, expose, reduce and accumulate one unit's gradient (mixed into ``FlatParamHandle``)."""

    def prepare_gradient(self) -> None:
        """Pre-backward: honour a ``zero_grad()`` the user called since the last backward.

        A ``no_sync`` gradient was shown where torch users look (``expose_unsharded_grad``);
        if that was set to None since, the user discarded it, and so do we.  With
        ``use_orig_params``: if the optimizer set the original grads to None, so is ours.
        """
        if self.grad_exposed:
            self.grad_exposed = False
            if self.use_orig_params:
                discarded = all(s.param.grad is None for s in self.layout.slots if s.param.requires_grad)
            else:
                discarded = self.flat_param.grad is not self.unsharded.grad
            if discarded:
                self.unsharded.grad = None
        if self.use_orig_params and all(s.param.grad is None for s in self.layout.slots):
            self.flat_param.grad = None
        g = self.flat_param.grad
        if self.sharded and not self.use_orig_params and g is not None and g.shape == self.flat_param.shape:
            # A reduced shard kept from an earlier backward (no zero_grad since): set it aside, as torch
            # (``_saved_grad_shard``), so that flat_param.grad can show this backward's full gradient.
            self.saved_grad_shard, self.flat_param.grad = g, None

    def _take_cast_grad(self) -> torch.Tensor | None:
        """NO_SHARD + param_dtype: add this backward's gradient into ``flat_param.grad`` as torch's AccumulateGrad.

        ``G = g`` (in the compute dtype) if there is none yet, else ``G += g`` in G's
        dtype (fp32 after a synced step, bf16 after a ``no_sync`` one).  Returns G.
        """
        g, self.unsharded.grad = self.unsharded.grad, None
        acc = self.flat_param.grad
        if g is None:
            return acc
        if acc is None:
            set_grad(self.flat_param, g)
            return g
        acc += g
        return acc

    def expose_unsharded_grad(self) -> None:
        """Post-backward under ``no_sync``: show the accumulated full gradient where torch FSDP1 keeps it.

        ``use_orig_params=False``: as ``flat_param.grad`` (full size, while the parameter
        is the local shard); ``use_orig_params=True``: as each original parameter's
        ``.grad`` (a full-shape view).  It is the same tensor as ``unsharded.grad``, so
        ``optimizer.zero_grad()`` discards it (``set_to_none``: the next pre-backward
        sees it gone) or zeroes it in place, exactly as in torch.
        """
        if self.casts_unsharded:
            g = self._take_cast_grad()  # it is flat_param.grad now
            if g is None or not self.use_orig_params:
                return
        else:
            g = self.unsharded.grad
            if g is None or (not self.sharded and not self.use_orig_params):
                return  # NO_SHARD without use_orig_params: it already is flat_param.grad
        if self.use_orig_params:
            for slot, v in zip(self.layout.slots, unflatten(g, self.layout)):
                if slot.param.requires_grad:  # now: a parameter frozen after wrapping gets none
                    set_grad(slot.param, v)
        else:
            set_grad(self.flat_param, g)  # flat_param.grad was None or set aside (prepare_gradient)
        self.grad_exposed = True

    def start_reduce(self) -> None:
        """Post-backward: divide, then start the reduce-scatter (or all-reduce) of the full gradient."""
        if self.casts_unsharded:
            self._take_cast_grad()
        grad = self.unsharded.grad if self.sharded else self.flat_param.grad
        if grad is None:
            return
        if self.tracer is not None:
            self.tracer.instant("reduce-scatter issued", self.name)
        self.grad_exposed = False
        if not self.sharded:  # NO_SHARD: all-reduce flat_param.grad (in place unless cast to reduce_dtype)
            if grad.dtype != self.reduce_dtype:
                grad = grad.to(self.reduce_dtype)
            if self.predivide > 1:
                grad.div_(self.predivide)
            work = self.comm.all_reduce(grad, self.groups.shard, async_op=True)
            self.pending.append((work, None, grad))
            return
        self.unsharded.grad = None  # the leaf lets go; padded_grad may reuse its memory
        if self.flat_param.grad is not None and self.flat_param.grad.shape != self.flat_param.shape:
            self.flat_param.grad = None  # a no_sync gradient shown there is in `grad` now
        padded_grad = prepare_for_reduce_scatter(grad, self.layout.padded_numel, self.reduce_dtype, self.predivide)
        out = torch.empty(self.layout.shard_numel, dtype=padded_grad.dtype, device=grad.device)
        work = self.comm.reduce_scatter(out, padded_grad, self.groups.shard, async_op=True)
        self.pending.append((work, out, padded_grad))

    def finish_reduce(self) -> None:
        """Wait, all-reduce across replicas (HYBRID), divide, accumulate into flat_param.grad."""
        if not self.pending:
            return  # nothing reduced since the last call (a no_sync backward leaves its gradient exposed)
        for work, out, grad in self.pending:
            with span(self.tracer, "reduce-scatter wait", self.name):
                work.wait()
            if out is None:  # NO_SHARD: grad is flat_param.grad, or its cast to reduce_dtype
                if self.postdivide > 1:
                    grad.div_(self.postdivide)
                if grad is not self.flat_param.grad or grad.dtype != self.grad_dtype:
                    set_grad(self.flat_param, grad.to(self.grad_dtype))  # torch: _cast_grad_to_param_dtype
                continue
            if self.groups.replicate is not None:
                self.comm.all_reduce(out, self.groups.replicate).wait()
            out = finish_reduced_shard(out, self.postdivide, self.grad_dtype)  # fp32 for the optimizer
            kept = self.saved_grad_shard if self.saved_grad_shard is not None else self.flat_param.grad
            self.saved_grad_shard = None
            if kept is None:
                set_grad(self.flat_param, out)
            else:
                kept += out  # accumulate onto the kept shard, in torch's order (kept + new)
                set_grad(self.flat_param, kept)
        self.pending.clear()
        if self.use_orig_params and self.flat_param.grad is not None:
            for slot, (lo, hi) in zip(self.layout.slots, self.local_pieces()):
                # as torch: no gradient where this rank holds none of the parameter, nor for one
                # frozen now (``p.requires_grad_(False)`` after wrapping: the optimizer skips it)
                if slot.param.requires_grad and hi > lo:
                    set_grad(slot.param, self.flat_param.grad[lo:hi].view(slot.param.shape))
                else:
                    slot.param.grad = None
            self._step_in_backward()

    def _step_in_backward(self) -> None:
        """``torch.distributed.optim._apply_optimizer_in_backward`` (use_orig_params): an original that carries
        ``_in_backward_optimizers`` is stepped as soon as its gradient shard is here, and its gradient
        dropped, as torch FSDP1's post-backward does; the flat gradient goes once no original holds one."""
        stepped = False
        for slot in self.layout.slots:
            optims = getattr(slot.param, "_in_backward_optimizers", None)
            if optims and slot.param.grad is not None:
                for opt in optims:
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                stepped = True
        if stepped and all(slot.param.grad is None for slot in self.layout.slots):
            self.flat_param.grad = None
