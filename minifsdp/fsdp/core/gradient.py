"""One unit's gradient, from autograd's full sum to the optimizer's shard.

    post-backward   full grad (compute dtype) --cast--> reduce_dtype --/f--> reduce-scatter  (started)
    later           wait --HYBRID: all-reduce across replicas--> /(N/f) --cast--> fp32
                    --> added into flat_param.grad (or into the shard kept from an earlier backward)

``later`` is the next unit's post-backward or the root's final callback: at most one
reduction in flight (on CPU the unit's own post-backward, as torch FSDP1 on CPU).  NO_SHARD
all-reduces the whole gradient with the same casts and divide factors (``strategy.py``).

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

import torch

from minifsdp.fsdp.core.state import GradState
from minifsdp.fsdp.core.strategy import finish_reduced_shard, predivide_factor, prepare_for_reduce_scatter


def set_grad(param: torch.nn.Parameter, grad: torch.Tensor) -> None:
    """``param.grad = grad`` although their shapes or dtypes differ (torch FSDP1 does the same): swap ``.data``."""
    data = param.data
    param.data = grad
    param.grad = grad
    param.data = data


class UnitGradient:
    """Prepare, keep, reduce and accumulate the gradient of one handle (``handle.py``)."""

    def __init__(self, handle):
        self.handle = handle
        self.state = GradState.SHARD
        self.in_flight = None  # while REDUCING: (work, output shard or None for NO_SHARD, the input kept alive)
        self.saved_shard = None  # a reduced shard set aside while flat_param.grad shows a full gradient
        dp = handle.groups.data_parallel_size if handle.sharded else handle.groups.shard_size
        self.predivide = predivide_factor(dp)
        self.postdivide = dp / self.predivide

    def prepare(self) -> None:
        """Pre-backward: honour a ``zero_grad()`` since the last backward; set a kept shard aside."""
        h = self.handle
        if self.state is GradState.UNSHARDED and h.flat_param.grad is not h.unsharded.grad:
            self.state = GradState.SHARD  # zero_grad(set_to_none=True) discarded the no_sync gradient
            h.unsharded.grad = None
        g = h.flat_param.grad
        if h.sharded and g is not None and g.shape == h.flat_param.shape:
            self.saved_shard, h.flat_param.grad = g, None  # torch's _saved_grad_shard

    def take_cast_grad(self) -> torch.Tensor | None:
        """NO_SHARD + param_dtype: this backward's ``g`` into ``flat_param.grad`` as AccumulateGrad would:
        ``G = g`` (in the compute dtype) if there is none yet, else ``G += g`` in G's dtype."""
        h = self.handle
        g, h.unsharded.grad = h.unsharded.grad, None
        acc = h.flat_param.grad
        if g is None:
            return acc
        if acc is None:
            set_grad(h.flat_param, g)
            return g
        acc += g
        return acc

    def keep_unsharded(self) -> None:
        """Post-backward inside ``no_sync``: show the accumulated full gradient as ``flat_param.grad``."""
        h = self.handle
        if h.casts_unsharded:
            self.take_cast_grad()  # it is flat_param.grad now
            return
        g = h.unsharded.grad
        if g is None or not h.sharded:
            return  # NO_SHARD: it already is flat_param.grad
        set_grad(h.flat_param, g)  # flat_param.grad was None or set aside (prepare)
        self.state = GradState.UNSHARDED

    def start_reduce(self) -> None:
        """Post-backward: cast, divide, start the reduce-scatter (NO_SHARD: all-reduce) of the full gradient."""
        h = self.handle
        self.finish_reduce()  # (never more than one in flight)
        if h.casts_unsharded:
            self.take_cast_grad()
        grad = h.unsharded.grad if h.sharded else h.flat_param.grad
        if grad is None:
            return
        if h.tracer is not None:
            h.tracer.instant("reduce-scatter issued", h.name)
        self.state = GradState.REDUCING
        if not h.sharded:  # all-reduce flat_param.grad, in place unless cast to reduce_dtype
            if grad.dtype != h.dtypes.reduce:
                grad = grad.to(h.dtypes.reduce)
            if self.predivide > 1:
                grad.div_(self.predivide)
            self.in_flight = (h.comm.all_reduce(grad, group=h.groups.shard, async_op=True), None, grad)
            return
        h.unsharded.grad = None  # the leaf lets go; the padded copy may reuse its memory
        if h.flat_param.grad is not None and h.flat_param.grad.shape != h.flat_param.shape:
            h.flat_param.grad = None  # a no_sync gradient shown there is `grad` now
        padded = prepare_for_reduce_scatter(grad, h.layout.padded_numel, h.dtypes.reduce, self.predivide)
        out = torch.empty(h.layout.shard_numel, dtype=padded.dtype, device=grad.device)
        self.in_flight = (h.comm.reduce_scatter(out, padded, group=h.groups.shard, async_op=True), out, padded)

    def finish_reduce(self) -> None:
        """Wait, all-reduce across replicas (HYBRID), divide by N/f, cast, accumulate into ``flat_param.grad``."""
        if self.in_flight is None:
            return
        h, (work, out, grad) = self.handle, self.in_flight
        self.in_flight = None
        with h.span("reduce-scatter wait"):
            work.wait()
        self.state = GradState.SHARD
        if out is None:  # NO_SHARD: grad is flat_param.grad, or its cast to reduce_dtype
            if self.postdivide > 1:
                grad.div_(self.postdivide)
            if grad is not h.flat_param.grad or grad.dtype != h.dtypes.grad:
                set_grad(h.flat_param, grad.to(h.dtypes.grad))  # torch: _cast_grad_to_param_dtype
            return
        if h.groups.replicate is not None:
            h.comm.all_reduce(out, group=h.groups.replicate, async_op=True).wait()
        out = finish_reduced_shard(out, self.postdivide, h.dtypes.grad)
        kept = self.saved_shard if self.saved_shard is not None else h.flat_param.grad
        self.saved_shard = None
        if kept is None:
            set_grad(h.flat_param, out)
        else:
            kept += out  # torch's order: kept + new
            set_grad(h.flat_param, kept)
