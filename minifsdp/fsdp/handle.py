"""The life of one FSDP unit's parameters in a training step: gather, use, free, reduce.

    forward    all-gather shards -> full flat buffer -> views as module.weight ... -> run
               FULL_SHARD / HYBRID_SHARD: free the full buffer after (not the root's)
    backward   pre-backward hook (on the unit's outputs): all-gather again if freed
               autograd sums every view's gradient into the full flat gradient
               post-backward hook (after that sum): divide, reduce-scatter (start),
               free the full buffer
    later      the next unit's post-backward (or the root's final callback for the last
               one) waits for the reduction, finishes the division and adds the result
               into ``flat_param.grad``: at most one reduction in flight

One unit's buffers, rank r of N, FULL_SHARD:

    flat_param       [ shard r ]                    nn.Parameter, what the optimizer steps
    padded           [ s0 | s1 | ... | sN-1 ]       all-gather target; storage freed between uses
    unsharded        [ s0 | s1 | ...   ]            autograd leaf = padded[:numel]; views come from it
    unsharded.grad   [ g ...           ]            summed by autograd, reduce-scattered, dropped

Note (freeing without breaking autograd): backward needs the tensors the
forward saved (a Linear saves its weight view).  We free a full buffer by
resizing its *storage* to 0 bytes and, before the backward, resize it back and
all-gather into the same storage, so every saved view sees the numbers again.
``unsharded`` gets its data by ``.data =`` and so has its own version counter:
writing the all-gather into ``padded`` is invisible to autograd's "modified by
an inplace operation" check, as in torch FSDP1.

Note (NO_SHARD): nothing to gather; ``unsharded`` *is* ``flat_param`` and its
gradient is all-reduced in place.

Note (one job): the handle owns a unit's tensors and the collectives that move
them; it never calls back into its unit.  The unit (``fully_sharded.py``) decides
*when* (hooks, order, state) and calls down; the handle reports what it did to an
attached tracer (``events.py``) and nothing else.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from minifsdp.fsdp.events import span
from minifsdp.fsdp.flat_param import build_layout, flatten, shard, unflatten
from minifsdp.fsdp.mixed_precision import MixedPrecision
from minifsdp.fsdp.sharding import (
    SHARDED,
    Comm,
    ShardGroups,
    ShardingStrategy,
    finish_reduced_shard,
    predivide_factor,
    prepare_for_reduce_scatter,
)
from minifsdp.fsdp.state import HandleState

__all__ = ["FlatParamHandle", "set_tensor_attr", "clear_tensor_attr"]


def set_tensor_attr(module: nn.Module, name: str, t: torch.Tensor) -> None:
    """Make ``module.<name>`` return ``t`` (a plain tensor, not a registered parameter).

    An instance attribute shadows ``module._parameters[name]`` (``nn.Module.__getattr__``
    is only asked when normal lookup fails), so the registration, and the order
    of ``named_parameters()``, stay untouched.
    """
    module.__dict__[name] = t


def clear_tensor_attr(module: nn.Module, name: str) -> None:
    module.__dict__.pop(name, None)


class FlatParamHandle:
    """One unit's flat parameter: its layout, local shard, full buffer and gradient reduction."""

    def __init__(self, module: nn.Module, params: list[nn.Parameter], groups: ShardGroups,
                 strategy: ShardingStrategy, use_orig_params: bool, comm: Comm,
                 mixed_precision: MixedPrecision | None = None):
        self.groups, self.strategy, self.use_orig_params, self.comm = groups, strategy, use_orig_params, comm
        self.sharded = strategy in SHARDED
        n = groups.shard_size if self.sharded else 1
        self.rank = groups.shard_rank if self.sharded else 0
        rg = {p.requires_grad for p in params}
        if len(rg) > 1 and not use_orig_params:
            frozen = [name for name, p in module.named_parameters() if p in set(params) and not p.requires_grad]
            raise ValueError(
                f"FSDP unit mixes frozen ({', '.join(frozen[:3])}...) and trainable parameters; one flat parameter "
                "has one requires_grad. Pass use_orig_params=True, or wrap the frozen part in its own unit."
            )
        # Mixed precision (mixed_precision.py): compute in param_dtype, reduce in reduce_dtype.
        self.orig_dtype = params[0].dtype
        self.param_dtype, self.reduce_dtype = (mixed_precision.dtypes_for(self.orig_dtype) if mixed_precision
                                               else (self.orig_dtype, self.orig_dtype))
        self.uses_param_mp = self.param_dtype != self.orig_dtype
        if (self.uses_param_mp or self.reduce_dtype != self.orig_dtype) and not self.sharded:
            raise NotImplementedError("MixedPrecision with NO_SHARD is not implemented in minifsdp; "
                                      "use FULL_SHARD, SHARD_GRAD_OP or HYBRID_SHARD")
        # torch aligns each parameter to 16 bytes (of the compute dtype) when use_orig_params=True; so do we.
        align = 16 // self.param_dtype.itemsize if use_orig_params else 0
        self.layout = build_layout(module, params, n, align_numel=align)
        full = flatten(self.layout)
        requires_grad = any(rg)
        self.full_precision = False  # summon_full_params: gather fp32 (torch's _force_full_precision)
        if self.sharded:
            self.flat_param = nn.Parameter(shard(full, self.rank, n), requires_grad=requires_grad)
            self.padded = torch.empty_like(full, dtype=self.param_dtype)
            self.unsharded = torch.empty(0, dtype=self.param_dtype, device=full.device).requires_grad_(requires_grad)
            self.unsharded.data = self.padded[: self.layout.numel]  # own version counter: see Note
            self.padded.untyped_storage().resize_(0)  # starts freed
            self.state = HandleState.SHARDED
        else:
            self.flat_param = nn.Parameter(full[: self.layout.numel].clone(), requires_grad=requires_grad)
            self.unsharded = self.flat_param
            self.state = HandleState.UNSHARDED
        self.flat_param._minifsdp_flat = True
        dp = groups.data_parallel_size if self.sharded else groups.shard_size
        self.predivide = predivide_factor(dp)
        self.postdivide = dp / self.predivide
        self.pending: list = []  # reductions started, not finished: (work, sharded_grad, keep_alive)
        self._gather = None  # while GATHERING: (work, the local shard being sent)
        self.name = "unit"  # its module path, set by the root (for the tracer)
        self.tracer = None  # a tools.tracing.Tracer while one is attached

    # ------------------------------------------------------------------ parameters
    def take_over_params(self) -> None:
        """After flattening: the module's names stop being the original parameters.

        Every original parameter is marked as owned (a parent unit must not flatten
        it again).  With ``use_orig_params=False`` it also leaves its module: the
        unit registers ``flat_param`` instead, and an optimizer still holding an
        original is refused at its first step (``checks.py``).  Then each name
        points at its sharded view (``use_sharded_views``).
        """
        for slot in self.layout.slots:
            slot.param._minifsdp_owner = True
            if not self.use_orig_params:
                slot.param._minifsdp_orphan = slot.fqn  # the optimizer-before-wrap check looks for it
                del slot.module._parameters[slot.name]
        if not self.use_orig_params:
            for sh in self.layout.shared:
                sh.module._parameters.pop(sh.name, None)
        self.use_sharded_views()

    def unshard(self) -> None:
        """All-gather the shards into the full buffer (no-op if already there); waits."""
        self.start_unshard()
        self.wait_unshard()

    def start_unshard(self, prefetch: bool = False) -> None:
        """Issue the all-gather (async); with mixed precision, of the shard cast to ``param_dtype``."""
        if self.state is not HandleState.SHARDED:
            return
        if self.tracer is not None:
            self.tracer.instant("all-gather issued", self.name, prefetch=prefetch)
        self.padded.untyped_storage().resize_(self.padded.numel() * self.padded.element_size())
        local = self.flat_param.data
        if self.padded.dtype != local.dtype:
            local = local.to(self.padded.dtype)  # torch: _mp_shard.copy_(local shard); one rounding
        work = self.comm.all_gather(self.padded, local, self.groups.shard, async_op=True)
        self._gather = (work, local)  # keep the sent tensor alive until the all-gather is done
        self.state = HandleState.GATHERING

    def wait_unshard(self) -> None:
        if self.state is HandleState.GATHERING:
            with span(self.tracer, "all-gather wait", self.name):
                self._gather[0].wait()
            self._gather = None
            self.state = HandleState.UNSHARDED

    def set_full_precision(self, on: bool) -> None:
        """summon_full_params under mixed precision: gather the fp32 shards into a separate fp32 buffer.

        The low-precision buffer and its autograd leaf are set aside and put back
        unchanged (the post-backward hook is registered on that leaf).
        """
        if not self.uses_param_mp or on == self.full_precision:
            return
        self.reshard()
        self.full_precision = on
        if on:
            self._low_precision = (self.padded, self.unsharded)
            self.padded = torch.empty(self.layout.padded_numel, dtype=self.orig_dtype, device=self.flat_param.device)
            self.unsharded = self.padded[: self.layout.numel]
        else:
            self.padded, self.unsharded = self._low_precision
            del self._low_precision

    def reshard(self) -> None:
        """Free the full buffer (sharded strategies only)."""
        self.wait_unshard()  # never free a buffer an all-gather is still writing
        if self.sharded and self.state is HandleState.UNSHARDED:
            self.padded.untyped_storage().resize_(0)
            self.state = HandleState.SHARDED

    def use_unsharded_views(self, as_data: bool = False, detach: bool = False) -> None:
        """Point every original name at its view of the full buffer.

        ``as_data=False`` (forward): plain-tensor views that carry autograd to
        ``unsharded``.  ``as_data=True`` (summon_full_params with use_orig_params):
        the original ``nn.Parameter`` s get the full views as their ``.data``.
        ``detach=True`` (summon_full_params): views outside autograd, editable in place.
        """
        views = unflatten(self.unsharded.detach() if detach else self.unsharded, self.layout)
        for slot, v in zip(self.layout.slots, views):
            if as_data:
                slot.param.data = v.detach()
                continue
            if self.use_orig_params and not slot.requires_grad:
                v = v.detach()
            set_tensor_attr(slot.module, slot.name, v)
        if not as_data:
            for sh in self.layout.shared:
                set_tensor_attr(sh.module, sh.name, views[sh.primary])

    def use_sharded_views(self) -> None:
        """Between uses: original params (use_orig_params) are 1-D views of their local piece."""
        for slot in self.layout.slots + self.layout.shared:
            clear_tensor_attr(slot.module, slot.name)
        if not self.use_orig_params:
            empty = self.flat_param.data.new_empty(0)
            for slot in self.layout.slots + self.layout.shared:
                set_tensor_attr(slot.module, slot.name, empty)  # no stale full view left behind
            return
        for slot, (lo, hi) in zip(self.layout.slots, self.local_pieces()):
            piece = self.flat_param.data[lo:hi]
            slot.param.data = piece if self.sharded else piece.view(slot.shape)

    def local_pieces(self) -> list[tuple[int, int]]:
        if self.sharded:
            return self.layout.local_pieces(self.rank)
        return [(s.offset, s.offset + s.numel) for s in self.layout.slots]

    def write_back(self) -> None:
        """Copy the local part of the full buffer back into the shard (after summon_full_params edits)."""
        if self.sharded and self.state is HandleState.UNSHARDED:
            start, end = self.layout.shard_range(self.rank)
            self.flat_param.data.copy_(self.padded[start:end])

    # ------------------------------------------------------------------ gradients
    def prepare_gradient(self) -> None:
        """Pre-backward (use_orig_params): if the optimizer set the original grads to None, so is ours."""
        if self.use_orig_params and all(s.param.grad is None for s in self.layout.slots):
            self.flat_param.grad = None

    def start_reduce(self) -> None:
        """Post-backward: divide, then start the reduce-scatter (or all-reduce) of the full gradient."""
        grad = self.unsharded.grad
        if grad is None:
            return
        if self.tracer is not None:
            self.tracer.instant("reduce-scatter issued", self.name)
        if not self.sharded:  # NO_SHARD: reduce flat_param.grad in place
            if self.predivide > 1:
                grad.div_(self.predivide)
            work = self.comm.all_reduce(grad, self.groups.shard, async_op=True)
            self.pending.append((work, None, grad))
            return
        self.unsharded.grad = None  # the leaf lets go; padded_grad may reuse its memory
        padded_grad = prepare_for_reduce_scatter(grad, self.layout.padded_numel, self.reduce_dtype, self.predivide)
        out = torch.empty(self.layout.shard_numel, dtype=padded_grad.dtype, device=grad.device)
        work = self.comm.reduce_scatter(out, padded_grad, self.groups.shard, async_op=True)
        self.pending.append((work, out, padded_grad))

    def finish_reduce(self) -> None:
        """Wait, all-reduce across replicas (HYBRID), divide, accumulate into flat_param.grad."""
        for work, out, grad in self.pending:
            with span(self.tracer, "reduce-scatter wait", self.name):
                work.wait()
            if out is None:  # NO_SHARD: grad is flat_param.grad
                if self.postdivide > 1:
                    grad.div_(self.postdivide)
                continue
            if self.groups.replicate is not None:
                self.comm.all_reduce(out, self.groups.replicate).wait()
            out = finish_reduced_shard(out, self.postdivide, self.flat_param.dtype)  # fp32 for the optimizer
            if self.flat_param.grad is None:
                self.flat_param.grad = out
            else:
                self.flat_param.grad += out
        self.pending.clear()
        if self.use_orig_params and self.flat_param.grad is not None:
            for slot, (lo, hi) in zip(self.layout.slots, self.local_pieces()):
                if slot.requires_grad:
                    slot.param.grad = self.flat_param.grad[lo:hi].view(slot.param.shape)

