"""The life of one FSDP unit's parameters in a training step: gather, use, free, reduce.

    forward    all-gather shards -> full flat buffer -> views as module.weight ... -> run
               FULL_SHARD / HYBRID_SHARD: free the full buffer after (not the root's)
    backward   pre-backward hook (on the unit's outputs): all-gather again if freed
               autograd sums every view's gradient into the full flat gradient
               post-backward hook (after that sum): divide, reduce-scatter (start),
               free the full buffer
    later      the next unit's post-backward (or the root's final callback for the last
               one) waits for the reduction, finishes the division and adds the result
               into ``flat_param.grad``: at most one reduction in flight (on CPU: none)

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
gradient is all-reduced in place.  With ``MixedPrecision(param_dtype=...)`` the
compute copy is a *cast* of ``flat_param`` instead (``casts_unsharded``): made
at each use, freed after it, as torch's ``_mp_shard``; HandleState then says
whether that copy exists (SHARDED: freed, UNSHARDED: cast).

The gradient half (reduce-scatter, all-reduce, accumulation) is ``reduction.py``.

Note (one job): the handle owns a unit's tensors and the collectives that move
them; it never calls back into its unit.  The unit (``fully_sharded.py``) decides
*when* (hooks, order, state) and calls down; the handle reports what it did to an
attached tracer (``events.py``) and nothing else.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from minifsdp.fsdp.dtype_change import adopt_dtype, check_dtype
from minifsdp.fsdp.events import span
from minifsdp.fsdp.flat_param import build_layout, flatten, shard, unflatten
from minifsdp.fsdp.mixed_precision import MixedPrecision
from minifsdp.fsdp.reduction import GradientReduction
from minifsdp.fsdp.sharding import SHARDED, Comm, ShardGroups, ShardingStrategy, predivide_factor
from minifsdp.fsdp.state import HandleState

__all__ = ["FlatParamHandle", "set_tensor_attr", "clear_tensor_attr"]


def set_tensor_attr(module: nn.Module, name: str, t: torch.Tensor) -> None:
    """Make ``module.<name>`` return ``t`` (a plain tensor, not a registered parameter).

    An instance attribute shadows ``module._parameters[name]`` (``nn.Module.__getattr__``
    is only asked when normal lookup fails), so the registration, and the order
    of ``named_parameters()``, stay untouched.

    Note (the module's own ``__setattr__``): the write goes through ``setattr``, so a
    module that overrides ``__setattr__`` sees every switch of views, as it does under
    torch FSDP1 (which switches with ``delattr`` + ``setattr``).  ``nn.Module.__setattr__``
    refuses a plain tensor under a registered parameter's name, so a registered name is
    taken out of ``_parameters`` for the write and put back in its place after it.
    """
    params = module._parameters
    if name not in params:
        setattr(module, name, t)
        return
    registered = dict(params)
    del params[name]
    try:
        setattr(module, name, t)
    finally:
        params.clear()
        params.update(registered)  # the same names in the same order


def clear_tensor_attr(module: nn.Module, name: str) -> None:
    """Undo :func:`set_tensor_attr`: ``module.<name>`` is the registered parameter (if any) again."""
    module.__dict__.pop(name, None)


class FlatParamHandle(GradientReduction):
    """One unit's flat parameter: its layout, local shard, full buffer; its gradient (``reduction.py``)."""

    def __init__(self, module: nn.Module, params: list[nn.Parameter], groups: ShardGroups,
                 strategy: ShardingStrategy, use_orig_params: bool, comm: Comm,
                 mixed_precision: MixedPrecision | None = None):
        self.groups, self.strategy, self.use_orig_params, self.comm = groups, strategy, use_orig_params, comm
        self.sharded = strategy in SHARDED
        n = groups.shard_size if self.sharded else 1
        self.rank = groups.shard_rank if self.sharded else 0
        dtypes = {p.dtype for p in params}
        if len(dtypes) > 1:
            by_dtype = {d: next(n for n, p in module.named_parameters() if p in set(params) and p.dtype == d)
                        for d in dtypes}
            raise ValueError(
                "FSDP unit mixes parameter dtypes (" + ", ".join(f"{n}: {d}" for d, n in by_dtype.items()) + "); "
                "one flat parameter has one dtype (torch: 'Must flatten tensors with uniform dtype'). Cast the "
                "module to one dtype first (module.to(torch.float32)), or wrap the odd part in its own unit."
            )
        rg = {p.requires_grad for p in params}
        if len(rg) > 1 and not use_orig_params:
            frozen = [name for name, p in module.named_parameters() if p in set(params) and not p.requires_grad]
            raise ValueError(
                f"FSDP unit mixes frozen ({', '.join(frozen[:3])}...) and trainable parameters; one flat parameter "
                "has one requires_grad. Pass use_orig_params=True, or wrap the frozen part in its own unit."
            )
        # Mixed precision (mixed_precision.py): compute in param_dtype, reduce in reduce_dtype.
        self.mixed_precision = mixed_precision
        self.orig_dtype = params[0].dtype  # may change until the root's first forward (dtype_change.py)
        self.dtype_fixed = False
        self.param_dtype, self.reduce_dtype = (mixed_precision.dtypes_for(self.orig_dtype) if mixed_precision
                                               else (self.orig_dtype, self.orig_dtype))
        self.uses_param_mp = self.param_dtype != self.orig_dtype
        keep_low = mixed_precision is not None and mixed_precision.keep_low_precision_grads
        self.grad_dtype = self.param_dtype if keep_low else self.orig_dtype  # what the optimizer receives
        self.casts_unsharded = self.uses_param_mp and not self.sharded  # NO_SHARD: cast, no gather
        self.frees = self.sharded or self.casts_unsharded  # the full (compute) buffer is freed between uses
        # torch aligns each parameter to 16 bytes (of the compute dtype) when use_orig_params=True; so do we.
        align = 16 // self.param_dtype.itemsize if use_orig_params else 0
        self.layout = build_layout(module, params, n, align_numel=align)
        full = flatten(self.layout)
        requires_grad = any(rg)
        self.full_precision = False  # summon_full_params: gather fp32 (torch's _force_full_precision)
        self.flat_param = nn.Parameter(shard(full, self.rank, n), requires_grad=requires_grad)  # n = 1: all
        if self.frees:
            shape, device = full.shape, full.device
            del full  # first: at most one unit-sized copy beside the originals (the peak of a meta-device init)
            self.padded = torch.empty(shape, dtype=self.param_dtype, device=device)
            self.unsharded = torch.empty(0, dtype=self.param_dtype, device=device).requires_grad_(requires_grad)
            self.unsharded.data = self.padded[: self.layout.numel]  # own version counter: see Note
            self.padded.untyped_storage().resize_(0)  # starts freed
            self.state = HandleState.SHARDED
        else:
            self.unsharded = self.flat_param
            self.state = HandleState.UNSHARDED
        self.flat_param._minifsdp_flat = True
        dp = groups.data_parallel_size if self.sharded else groups.shard_size
        self.predivide = predivide_factor(dp)
        self.postdivide = dp / self.predivide
        self.pending: list = []  # reductions started, not finished: (work, sharded_grad, keep_alive)
        self.grad_exposed = False  # a no_sync gradient is shown on flat_param.grad / the originals' .grad
        self.saved_grad_shard = None  # a reduced shard set aside while flat_param.grad shows a full gradient
        self._gather = None  # while GATHERING: (work, the local shard being sent)
        self.gathered_from = None  # shard_version() at the last gather (or cast)
        self.name = "unit"  # its module path, set by the root (for the tracer)
        self.tracer = None  # a tools.tracing.Tracer while one is attached

    # ------------------------------------------------------------------ parameters
    def take_over_params(self) -> None:
        """After flattening: the module's names stop being the original parameters.

        With ``use_orig_params=False`` each original leaves its module: the unit
        registers ``flat_param`` instead, an optimizer still holding an original is
        refused at its first step (``checks.py``), and the layout lets go of it
        (``slot.param = None``), so its full-size data is freed unless the user still
        holds it (as in torch).  With ``use_orig_params=True`` the originals stay,
        their ``.data`` a view of this rank's shard, and are marked as owned, so a
        parent unit does not flatten them again (torch's ``_fsdp_flattened`` mark, set
        only then).  Either way each records where it was flattened, for the error or
        warning about a weight tied across units (``wrap.check_ties_across_units``).
        Then each name points at its sharded view (``use_sharded_views``), registered anew
        with ``use_orig_params``: a module lists its flattened names in the flat parameter's
        order, a tied weight's second name last (``output_proj.bias`` before the tied
        ``output_proj.weight``), as torch FSDP1's ``module._parameters`` and state dicts do.
        """
        for slot in self.layout.slots:
            slot.param._minifsdp_flattened_at = (slot.module, slot.name)
            if self.use_orig_params:
                slot.param._minifsdp_owner = True
            else:
                slot.param._minifsdp_orphan = slot.fqn  # the optimizer-before-wrap check looks for it
                del slot.module._parameters[slot.name]
                slot.param = None  # the flat buffer holds the numbers now: keep no full-size copy
        for sh in self.layout.shared:
            sh.module._parameters.pop(sh.name, None)
        if self.use_orig_params:  # registered again below, as torch: each module's slots, then its tied names
            for slot in self.layout.slots:
                slot.module._parameters.pop(slot.name, None)
        self.use_sharded_views()

    def unshard(self) -> None:
        """All-gather the shards into the full buffer (no-op if already there); waits."""
        self.start_unshard()
        self.wait_unshard()

    def start_unshard(self, prefetch: bool = False) -> None:
        """Issue the all-gather (async); with mixed precision, of the shard cast to ``param_dtype``."""
        if self.dtype_fixed and self.frees:
            check_dtype(self)  # model.half() after the first forward: torch's error
        else:
            adopt_dtype(self)  # model.half() before it: gather (and compute) in the new dtype
        if self.stale():
            self.reshard()  # kept since its gather, but an optimizer step changed the shard since: gather again
        if self.state is not HandleState.SHARDED:
            return
        self.gathered_from = self.shard_version()
        self.padded.untyped_storage().resize_(self.padded.numel() * self.padded.element_size())
        if self.casts_unsharded:  # NO_SHARD: torch's _mp_shard.copy_(local shard), nothing to gather
            self.padded.copy_(self.flat_param.data)
            self.state = HandleState.UNSHARDED
            return
        if self.tracer is not None:
            self.tracer.instant("all-gather issued", self.name, prefetch=prefetch)
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

    def shard_version(self) -> tuple[int, ...]:
        """The local shard's version counters: an in-place update (an optimizer step) bumps them.

        With ``use_orig_params`` the optimizer steps the original parameters, views of
        the shard made by ``.data =``, which keep counters of their own: read those too.
        """
        if not self.use_orig_params:
            return (self.flat_param._version,)
        return (self.flat_param._version, *(s.param._version for s in self.layout.slots))

    def stale(self) -> bool:
        """The full buffer is there, but the shard changed since it was gathered (an optimizer step since)."""
        return self.frees and self.state is not HandleState.SHARDED and self.gathered_from != self.shard_version()

    def refresh_requires_grad(self) -> None:
        """``use_orig_params``: the flat parameter requires grad while one of its originals does.

        Read at every root forward, as torch's ``_reset_flat_param_grad_info_if_needed``,
        so that ``p.requires_grad_(False)`` *after* wrapping freezes ``p``: its view is
        detached, its ``.grad`` stays None and the optimizer skips it; a unit whose
        originals are all frozen stops computing a gradient (``backward.py``'s frozen path).
        Without ``use_orig_params`` the flat parameter's own flag is the one the user sets
        (``model.parameters()`` yields it): the gradient leaf follows it, so a unit frozen
        at wrapping and unfrozen later trains (torch's leaf is the flat parameter itself).
        """
        if self.use_orig_params:
            rg = any(s.param.requires_grad for s in self.layout.slots)
        else:
            rg = self.flat_param.requires_grad
        for t in (self.flat_param, self.unsharded):
            if t.requires_grad != rg:
                t.requires_grad_(rg)

    def reshard(self) -> None:
        """Free the full buffer (sharded strategies, or NO_SHARD's low-precision copy)."""
        self.wait_unshard()  # never free a buffer an all-gather is still writing
        if self.frees and self.state is HandleState.UNSHARDED:
            self.padded.untyped_storage().resize_(0)
            self.state = HandleState.SHARDED

    def use_unsharded_views(self, in_forward: bool = False) -> None:
        """Forward and backward: every original name is a plain-tensor view of the full buffer.

        The views carry autograd to ``unsharded``, so their gradients sum into its
        ``.grad``; a tied weight's second name gets the *same* view object.  With
        ``use_orig_params``, ``in_forward``, they are registered too, so that
        ``named_parameters()`` inside the forward yields them (full shapes, plain tensors),
        as torch FSDP1's ``_use_unsharded_views``; :meth:`use_sharded_views` registers the
        originals again.  (In the backward torch's ``named_parameters()`` yields none of
        them; ours keeps the originals registered there.)
        """
        views = unflatten(self.unsharded, self.layout)
        for slot, v in zip(self.layout.slots, views):
            if self.use_orig_params and not slot.param.requires_grad:  # frozen now (maybe after wrapping)
                v = v.detach()
            set_tensor_attr(slot.module, slot.name, v)
            if self.use_orig_params and in_forward:
                slot.module._parameters[slot.name] = v
        for sh in self.layout.shared:
            set_tensor_attr(sh.module, sh.name, views[sh.primary])
            if self.use_orig_params and in_forward:
                sh.module._parameters[sh.name] = views[sh.primary]

    def use_full_params(self) -> None:
        """summon_full_params: every original name is an ``nn.Parameter`` of its full shape, as torch shows it.

        ``use_orig_params=True``: the original parameters themselves, their ``.data``
        a view of the full buffer.  ``use_orig_params=False``: new ``nn.Parameter`` s
        registered under the original names (tied names share one), so
        ``model.named_parameters()`` yields ``blocks.0.attn.qkv.weight`` and not the
        flat parameter (the unit deregisters ``_flat_param`` meanwhile).  Either way
        they share the full buffer's memory, outside autograd: an in-place edit lands
        in the buffer, and ``write_back`` copies it into the shard.
        """
        views = unflatten(self.unsharded.detach(), self.layout)
        if self.use_orig_params:
            for slot, v in zip(self.layout.slots, views):
                slot.param.data = v
            return
        params = []
        for slot, v in zip(self.layout.slots, views):
            params.append(nn.Parameter(v, requires_grad=slot.requires_grad))
        for slot, p in zip(self.layout.slots, params):
            clear_tensor_attr(slot.module, slot.name)
            slot.module._parameters[slot.name] = p
        for sh in self.layout.shared:
            clear_tensor_attr(sh.module, sh.name)
            sh.module._parameters[sh.name] = params[sh.primary]

    def show_full_grads(self) -> list:
        """summon_full_params(with_grads=True), use_orig_params: each original's ``.grad`` becomes its full
        gradient (collective: the shards' gradients all-gathered, zeros for a rank that has none; None
        everywhere if no rank has one, as torch).  Returns the shards' gradients, for :meth:`restore_grads`."""
        before = [s.param.grad for s in self.layout.slots]
        local = torch.zeros(self.layout.shard_numel if self.sharded else self.layout.numel,
                            dtype=self.flat_param.dtype, device=self.flat_param.device)
        for (lo, hi), g in zip(self.local_pieces(), before):
            if g is not None and hi > lo:
                local[lo:hi] = g.reshape(-1)
        has = torch.tensor([float(any(g is not None for g in before))], device=local.device)
        if self.sharded:
            self.comm.all_reduce(has, self.groups.shard).wait()
        if has.item() == 0:
            return before
        full = local
        if self.sharded:
            full = torch.empty(self.layout.padded_numel, dtype=local.dtype, device=local.device)
            self.comm.all_gather(full, local, self.groups.shard).wait()
        for slot, v in zip(self.layout.slots, unflatten(full[: self.layout.numel], self.layout)):
            slot.param.grad = v if slot.param.requires_grad else None
        return before

    def restore_grads(self, before: list) -> None:
        for slot, g in zip(self.layout.slots, before):
            slot.param.grad = g

    def drop_full_params(self) -> None:
        """Undo :meth:`use_full_params`: the names become sharded views again."""
        if not self.use_orig_params:
            for slot in self.layout.slots + self.layout.shared:
                slot.module._parameters.pop(slot.name, None)
        self.use_sharded_views()

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
            slot.module._parameters[slot.name] = slot.param  # registered again (the forward's views out)
        for sh in self.layout.shared:
            sh.module._parameters[sh.name] = self.layout.slots[sh.primary].param

    def local_pieces(self) -> list[tuple[int, int]]:
        if self.sharded:
            return self.layout.local_pieces(self.rank)
        return [(s.offset, s.offset + s.numel) for s in self.layout.slots]

    def write_back(self) -> None:
        """Copy the local part of the full buffer back into the shard (after summon_full_params edits)."""
        if self.frees and self.state is HandleState.UNSHARDED:
            start, end = self.layout.shard_range(self.rank)
            self.flat_param.data.copy_(self.padded[start:end])
