"""One unit's gradient, from autograd's full sum to the optimizer's shard (the post-backward's half of the step).

    post-backward   full grad (compute dtype) --cast--> reduce_dtype --/f--> reduce-scatter  (started)
    later           wait --HYBRID: all-reduce across replicas--> /(N/f) --cast--> fp32
                    --> added into flat_param.grad (or into the shard kept from an earlier backward)
                    (keep_low_precision_grads: the sum cast to param_dtype; NO_SHARD's kept in reduce_dtype)

The reduce-scatter and its two divides on N = 4 ranks, f = 2 (``strategy.py``, Note).  Rank r's padded full
gradient is four shard-sized pieces [ar br cr dr]; piece i of every rank is summed onto rank i:

    rank 0   [a0 b0 c0 d0] / 2  --+                        rank 0: (a0 + a1 + a2 + a3) / 2  --/2-->  mean of a
    rank 1   [a1 b1 c1 d1] / 2  --+--  reduce-scatter -->  rank 1: (b0 + b1 + b2 + b3) / 2  --/2-->  mean of b
    rank 2   [a2 b2 c2 d2] / 2  --+                        rank 2: (c0 + c1 + c2 + c3) / 2  --/2-->  mean of c
    rank 3   [a3 b3 c3 d3] / 2  --+                        rank 3: (d0 + d1 + d2 + d3) / 2  --/2-->  mean of d

torch does the same in ``_runtime_utils.py``: ``_post_backward_hook`` casts to the reduce dtype,
``_reduce_grad`` pads (``_get_reduce_scatter_tensors``), divides (``_div_if_needed``), reduce-scatters,
all-reduces over the replicas (HYBRID), divides again, and ``_accumulate_sharded_grad`` casts back and adds
the shard to ``_saved_grad_shard`` (or stores it there); NO_SHARD's path is ``_reduce_grad_no_shard``.

Why reduce-scatter and not all-reduce?  Each rank only steps its own 1/N of the parameters, so
it only needs the sum of its 1/N of the gradient: a reduce-scatter moves half the bytes of an
all-reduce (chapter 2.2) and leaves each rank exactly that.  NO_SHARD keeps whole parameters,
so it all-reduces the whole gradient, as DDP does, with the same casts and divide factors.
The plan (``strategy.py``) says which: ``plan.reduce_scatters`` and ``plan.all_reduces``.

``later`` is the next unit's post-backward or the root's final callback (on CPU the unit's own
post-backward, as torch FSDP1's): the step (``fsdp.py``) decides when; this module only does.

Where the gradient lives, in torch FSDP1's places so ``optimizer.zero_grad()`` reaches it:

    strategy                     autograd sums into         the optimizer reads
    sharded                      unsharded.grad (full)      flat_param.grad (shard, fp32)
    NO_SHARD                     flat_param.grad            flat_param.grad (all-reduced in place)
    NO_SHARD + param_dtype       unsharded.grad (bf16)      flat_param.grad (fp32, a cast of the all-reduce)

Inside ``no_sync()`` nothing is reduced: the full gradient stays, shown as ``flat_param.grad``
(``GradState.UNSHARDED``); a reduced shard nobody zeroed is set aside meanwhile (torch's
``_saved_grad_shard``) and the next synced backward adds its new shard to it.

Note (NO_SHARD + param_dtype): torch's flat parameter *is* the low-precision leaf in forward and
backward, so AccumulateGrad adds the bf16 gradient straight into ``flat_param.grad``; our leaf is
``unsharded``, so :meth:`UnitGradient.take_cast_grad` moves it there by the same rule.
"""

from dataclasses import dataclass
from enum import Enum, auto

import torch
import torch.nn.functional as F


class GradState(Enum):  # where the unit's gradient is (core/state.py draws the machine)
    SHARD = auto()  # in flat_param.grad as this rank's reduced shard (or None): what the optimizer steps
    UNSHARDED = auto()  # whole, summed over no_sync backwards, shown as flat_param.grad
    REDUCING = auto()  # a reduce-scatter (NO_SHARD: all-reduce) of the whole gradient is in flight

def reduction_input(grad: torch.Tensor, padded_numel: int, reduce_dtype: torch.dtype,
                    predivide: float) -> torch.Tensor:
    """Each rank's reduce-scatter (NO_SHARD: all-reduce) input, in torch FSDP1's order: cast, pad to
    ``padded_numel``, divide by ``f`` (in place on ``grad`` itself when no cast and no padding made a copy)."""
    if grad.dtype != reduce_dtype:
        # a copy, in the dtype the sum is taken in
        grad = grad.to(reduce_dtype)
    # the padded tail: zeros, so they add nothing to the sum
    if (pad := padded_numel - grad.numel()) > 0:
        grad = F.pad(grad, [0, pad])
    if predivide > 1:
        grad.div_(predivide)
    return grad

def finish_reduced_shard(shard: torch.Tensor, postdivide: float, dtype: torch.dtype) -> torch.Tensor:
    """After the reduce-scatter (NO_SHARD: all-reduce): divide the summed shard by ``N / f``, cast it to ``dtype``."""
    if postdivide > 1:
        # the sum of N gradients each divided by f, now divided by N in all
        shard.div_(postdivide)
    return shard.to(dtype) if shard.dtype != dtype else shard

def set_grad(param: torch.nn.Parameter, grad: torch.Tensor) -> None:
    """``param.grad = grad`` although their shapes or dtypes differ (torch FSDP1 does the same): swap ``.data``."""
    data = param.data
    # torch checks .grad against .data: match them for the assignment
    param.data = grad
    param.grad = grad
    param.data = data

@dataclass
class Reduction:
    """A reduction in flight: ``out`` is the summed shard (all-reduced: the whole gradient), ``sent`` its input."""
    # what the collective returned: wait() blocks until it is done
    work: object
    out: torch.Tensor
    # kept alive until the collective is done with it
    sent: torch.Tensor

class UnitGradient:
    """Prepare, keep, reduce and accumulate the gradient of one handle (``handle.py``)."""

    def __init__(self, handle):
        self.handle, self.state = handle, GradState.SHARD
        # a Reduction while REDUCING; a reduced shard set aside while flat_param.grad shows a full gradient:
        self.in_flight = self.saved_shard = None
        # f and N / f (strategy.py, Note)
        self.predivide, self.postdivide = handle.plan.divide_factors()
        self.keeps_low = getattr(handle.mixed_precision, "keep_low_precision_grads", False)  # (mixed_precision.py)

    @property
    def reduces_in_hook(self) -> bool:
        """On a CPU torch FSDP1 reduces synchronously in the post-backward hook, and so do we: a full gradient never
        outlives its hook (+1 block at the peak); NO_SHARD's, reduced in place, is done before autograd adds more."""
        return self.handle.flat_param.device.type == "cpu"

    def prepare(self) -> None:
        """Pre-backward: honour a ``zero_grad()`` since the last backward; set a kept shard aside.

        Why set it aside?  ``flat_param.grad`` may show this backward's full gradient (no_sync) before the
        new shard arrives; the old shard waits in ``saved_shard`` until :meth:`finish_reduce` adds the new one.
        torch does this in ``FlatParamHandle.prepare_gradient_for_backward``, telling a shard from a no_sync
        gradient by ``.grad``'s size, as ``g.shape == h.flat_param.shape`` does here."""
        h = self.handle
        if self.state is GradState.UNSHARDED and h.flat_param.grad is not h.unsharded.grad:
            # zero_grad(set_to_none=True) discarded the no_sync gradient
            self.state = GradState.SHARD
            h.unsharded.grad = None
        # a reduced shard from an earlier backward nobody zeroed: accumulate onto it
        g = h.flat_param.grad
        if h.sharded and g is not None and g.shape == h.flat_param.shape:
            self.saved_shard, h.flat_param.grad = g, None  # torch's _saved_grad_shard

    def take_cast_grad(self) -> torch.Tensor | None:
        """NO_SHARD + param_dtype: this backward's ``g`` into ``flat_param.grad`` as AccumulateGrad would:
        ``G = g`` (in the compute dtype) if there is none yet, else ``G += g`` in G's dtype."""
        h = self.handle
        g, h.unsharded.grad, acc = h.unsharded.grad, None, h.flat_param.grad
        if g is not None and acc is not None:
            # in acc's dtype, as AccumulateGrad
            acc += g
        elif g is not None:
            set_grad(h.flat_param, g)
        return acc if acc is not None else g

    def keep_unsharded(self) -> None:
        """Post-backward inside ``no_sync``: show the accumulated full gradient as ``flat_param.grad``."""
        h = self.handle
        if h.casts_unsharded:
            # it is flat_param.grad now
            g = self.take_cast_grad()
        else:
            # (NO_SHARD: unsharded is flat_param, so it already is flat_param.grad)
            g = h.unsharded.grad
            if g is not None and h.sharded:
                # flat_param.grad was None or set aside (prepare)
                set_grad(h.flat_param, g)
        if g is not None:
            self.state = GradState.UNSHARDED

    def start_reduce(self) -> None:
        """Post-backward: cast, divide, start the reduce-scatter (NO_SHARD: all-reduce) of the full gradient."""
        h, scattered = self.handle, self.handle.plan.reduce_scatters
        if h.casts_unsharded:
            self.take_cast_grad()
        # the full gradient autograd summed
        grad = h.unsharded.grad if scattered else h.flat_param.grad
        if grad is None:
            return
        # until finish_reduce: the step decides when (fsdp.py)
        self.state = GradState.REDUCING
        if scattered:
            # the leaf lets go; the padded copy may reuse its memory
            h.unsharded.grad = None
            if h.flat_param.grad is not None and h.flat_param.grad.shape != h.flat_param.shape:
                # a no_sync gradient shown there is `grad` now
                h.flat_param.grad = None
        # NO_SHARD all-reduces flat_param.grad in place, unless cast to reduce_dtype: nothing to pad
        sent = reduction_input(grad, h.layout.padded_numel if scattered else grad.numel(),
                               h.dtypes.reduce, self.predivide)
        if scattered:
            out = torch.empty(h.flat_param.numel(), dtype=sent.dtype, device=grad.device)  # this rank's 1/N
            self.in_flight = Reduction(h.comm.reduce_scatter(out, sent, group=h.groups.shard, async_op=True), out, sent)
        else:
            self.in_flight = Reduction(h.comm.all_reduce(sent, group=h.groups.shard, async_op=True), sent, sent)

    def finish_reduce(self) -> bool:
        """Wait, all-reduce across replicas (HYBRID), divide by N/f, cast, accumulate into ``flat_param.grad``.
        Returns whether a reduction was in flight.

        torch adds the shard into ``_saved_grad_shard`` and moves it to ``.grad`` only at the end of the
        backward (``_finalize_params`` -> ``FlatParamHandle.prepare_gradient_for_optim``); ours is in
        ``flat_param.grad`` as soon as this returns."""
        if self.in_flight is None:
            return False
        h, r, self.in_flight = self.handle, self.in_flight, None
        # (a reduction started async_op=True: its numbers are there only after the wait)
        r.work.wait()
        self.state = GradState.SHARD
        if not h.plan.reduce_scatters:  # NO_SHARD: r.out is flat_param.grad, or its cast to reduce_dtype
            # torch: _cast_grad_to_param_dtype, which keep_low_precision_grads skips (kept in reduce_dtype)
            out = finish_reduced_shard(r.out, self.postdivide, r.out.dtype if self.keeps_low else h.dtypes.grad)
            if out is not h.flat_param.grad:
                set_grad(h.flat_param, out)
            return True
        if h.plan.all_reduces:  # HYBRID: the shard group's sum, summed again over the replicas
            h.comm.all_reduce(r.out, group=h.groups.replicate, async_op=True).wait()
        out = finish_reduced_shard(r.out, self.postdivide, h.dtypes.orig)
        kept = self.saved_shard if self.saved_shard is not None else h.flat_param.grad
        # (consumed: this backward's shard is added to it)
        self.saved_shard = None
        if kept is not None:
            # torch's order: kept + new, in the shards' dtype (torch: prepare_gradient_for_backward upcasts)
            if self.keeps_low:
                kept.data = kept.to(out.dtype)
            out = kept.add_(out)
        if self.keeps_low:  # then cast down once (torch: prepare_gradient_for_optim)
            out.data = out.to(h.dtypes.grad)
        set_grad(h.flat_param, out)
        return True
