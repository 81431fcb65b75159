"""``use_orig_params=True``: the original parameters stay, as views of the flat shard.

torch FSDP1's flag.  With it the optimizer steps the *original* parameters (each a 1-D piece
of the local shard, or the whole tensor under NO_SHARD) instead of one flat parameter, so
optimizer parameter groups, frozen parameters inside a unit, and per-parameter learning
rates work as on the plain model.  The algorithm is the core's (``core/handle.py``,
``core/gradient.py``); what changes is where each name points, which :class:`OrigParams` (an
extension of each unit, ``core/extension.py``) sets at the step's fixed points:

    moment              use_orig_params=False (core)           use_orig_params=True (here)      point
    between uses        names are empty tensors; the module   names are the originals,          after_reshard
                        registers ``_flat_param``              registered, ``.data`` = their
                                                               piece of the shard
    forward             names are views of the full buffer     the same, and registered (so      after_unshard
                                                               named_parameters() shows them)
    backward            (the forward's views)                  views again (a recompute reads    after_unshard
                                                               them; a backward prefetch's:      before_forward
                                                               Note (recompute))
    gradient            ``flat_param.grad`` (the shard)        each original's ``.grad`` = its   after_reduce
                                                               piece
    summon              new full-shape Parameters              the originals, ``.data`` = full   after_unshard
                                                               view
    before a gather     -                                      the write-back (below)            before_unshard

Note (alignment): torch aligns each original to 16 bytes in the flat buffer when
``use_orig_params=True``, so each piece is a valid tensor start, and pads the end to a multiple of the
group's size, NO_SHARD's too (``_flat_param.py``'s ``_init_flat_param_and_metadata``): Linear(5, 13) in a unit
of its own, 65 + 13 numbers, is 65 + 3 + 13 = 81 aligned and 82 on 2 ranks, and NO_SHARD all-reduces 82.  So do
we (:func:`aligned`, at ``on_wrap``).

Note (frozen originals): a unit may mix frozen and trainable originals; the optimizer skips a frozen one, and
after a synced backward it gets no ``.grad``.  Its forward view is not detached, as torch's is not
(``_use_unsharded_views`` cuts every view from the flat parameter, which requires a gradient if any original
does): autograd computes its gradient into the flat gradient, so a unit reached only through frozen originals
still reduce-scatters its (whole) gradient, as torch's does.  ``p.requires_grad_(False)``
after wrapping works too (read again at every root forward).  Inside ``no_sync()`` torch gives a frozen original
a ``.grad`` all the same (``_use_unsharded_grad_views`` checks no ``requires_grad``); ours does not
(``minifsdp/fuzz/known.py``, ``frozen_originals_get_grads_under_no_sync``).

Note (write-back, as torch's ``_writeback_orig_params``): between steps a user may give an original
new storage (``p.data = t``, ``p.grad = g``) or put a new ``nn.Parameter`` under its name.  Before every
all-gather the handle copies such a tensor into the flat shard (and a gradient into the flat gradient),
so the all-gather sends what the user sees; a piece of another shape is an error.  SHARD_GRAD_OP keeps
the forward's full-shape views until the backward (torch's "skipped sharded views"): changing them in
between is an error too.

Note (recompute): a checkpoint around a unit (``apply_activation_checkpointing`` on a block whose Linear is a
unit of its own) recomputes the unit's forward inside the backward, *before* the unit's pre-backward.  If the
backward prefetched the unit (BACKWARD_PRE from the unit after it), that forward finds its all-gather started
and makes no views (``core/fsdp.py``, ``_pre_forward``), while the names are still the 1-D pieces of the shard.
torch's prefetch makes the pre-backward views at once (``_prefetch_handle`` -> ``FlatParamHandle.unshard`` ->
``_use_unsharded_views``: the forward's ``_tensors``, ``.data`` the full buffer), and the recompute computes
with them; ours makes the same views at that forward's start (:meth:`OrigParams.before_forward`).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from minifsdp.fsdp.core.extension import Extension
from minifsdp.fsdp.core.flat_param import FlatParamLayout, ParamSlot, padded_size, unflatten
from minifsdp.fsdp.core.fsdp import TrainingState
from minifsdp.fsdp.core.gradient import GradState, set_grad
from minifsdp.fsdp.core.handle import HandleState
from minifsdp.fsdp.core.mixed_precision import resolve_dtypes

__all__ = ["OrigParams", "aligned", "set_tensor_attr", "clear_tensor_attr", "show_full_grads", "drop_full_grads",
           "restore_grads"]

ALIGN_BYTES = 16  # torch's: each original starts at a multiple of 16 bytes in the flat buffer


def aligned(layout: FlatParamLayout, align_numel: int, group_size: int) -> FlatParamLayout:
    """``layout`` with each parameter starting at a multiple of ``align_numel`` and the end padded to a multiple
    of ``group_size``, under NO_SHARD too (the gaps hold zeros; torch's hold 42, a marker never read)."""
    slots, offset = [], 0
    for s in layout.slots:
        if offset % align_numel:
            offset += align_numel - offset % align_numel
        slots.append(ParamSlot(s.fqn, s.module, s.name, s.shape, offset, s.numel, s.requires_grad, s.param))
        offset += s.numel
    return FlatParamLayout(slots, layout.shared, layout.world_size, offset, padded_size(offset, group_size))


def set_tensor_attr(module: nn.Module, name: str, t: torch.Tensor) -> None:
    """Make ``module.<name>`` return ``t`` (a plain tensor), leaving ``_parameters`` as registered.

    The write goes through ``setattr``, so a module that overrides ``__setattr__`` sees every
    switch of views, as under torch FSDP1.  ``nn.Module.__setattr__`` refuses a plain tensor
    under a registered parameter's name, so that name leaves ``_parameters`` for the write and
    comes back in its place.
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


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _checked(t: torch.Tensor, numel: int, sharded: bool, fqn: str, what: str) -> torch.Tensor:
    """``t`` flattened for the write-back, if it has the piece's shape (sharded: 1-D of ``numel``)."""
    flat = t if sharded else t.reshape(-1)
    if flat.shape != torch.Size([numel]):
        raise RuntimeError(f"Cannot writeback when the {what} shape changes: {fqn!r} expects "
                           f"{torch.Size([numel])} but got {t.shape} (torch FSDP1 raises this too). With "
                           "use_orig_params=True each rank's original is its 1-D piece of the shard; assign a "
                           "tensor of that shape, or change the full parameter inside FSDP.summon_full_params.")
    return flat


def _piece(h, slot, lo: int, hi: int) -> torch.Tensor:
    """An original's view of the local shard: 1-D when sharded, its own shape under NO_SHARD."""
    piece = h.flat_param.data[lo:hi]
    return piece if h.sharded else piece.view(slot.shape)


def local_pieces(h) -> list[tuple[int, int]]:
    """For each slot of handle ``h``, the [lo, hi) of this rank's ``flat_param`` it covers."""
    if h.sharded:
        return h.layout.local_pieces(h.rank)
    return [(s.offset, s.offset + s.numel) for s in h.layout.slots]


def _keeps_views_after_forward(unit) -> bool:
    """As torch: a unit that keeps its full parameters after the forward (SHARD_GRAD_OP) with autograd on
    keeps the forward's views too, so ``p.shape`` is the full shape until the backward."""
    return unit.plan.shards_params and not unit.plan.frees_after_forward


class OrigParams(Extension):
    """``use_orig_params=True`` for one unit: the originals stay, as views of the shard (the table above)."""

    def __init__(self):
        self.originals: list[nn.Parameter] = []  # the unit's originals, kept from wrap time (the core lets go)
        self.forward_views = None  # SHARD_GRAD_OP after a forward with grad: the full views the names still are
        self.graph_views = None  # the last forward's views, the tensors its autograd graph holds (torch's _tensors)
        self.backward_prefetched = False  # its all-gather was started by a backward prefetch (Note (recompute))

    def on_wrap(self, unit, layout):
        if layout is None:
            return None
        itemsize = resolve_dtypes(unit.mixed_precision, layout.slots[0].param.dtype).param.itemsize
        layout = aligned(layout, ALIGN_BYTES // itemsize, unit.groups.shard_size)
        self.originals = [s.param for s in layout.slots]
        return layout

    # ------------------------------------------------------------------ where the names point
    def before_forward(self, unit, args, kwargs) -> None:
        """A forward of a unit the backward prefetched (a checkpoint's recompute): the pre-backward views now, as
        torch's prefetch made them (Note (recompute)); the forward then computes with them."""
        if self.backward_prefetched and unit._handle.state is not HandleState.SHARDED:
            self.use_unsharded_views(unit, registered=False)
        self.backward_prefetched = False

    def after_reshard(self, unit) -> None:
        self.backward_prefetched = False
        if unit.training_state is TrainingState.FORWARD and torch.is_grad_enabled() \
                and _keeps_views_after_forward(unit):
            return
        self.use_sharded_views(unit)

    def after_backward(self, unit) -> None:
        """The final callback: a unit that kept the forward's full views (SHARD_GRAD_OP, autograd on) and that
        the backward never reached is resharded, as torch's ``_catch_all_reshard`` does for a handle that
        skipped its sharded views (the core leaves a unit the backward never reached as its forward left it)."""
        if self.forward_views is not None and unit._handle is not None \
                and unit._handle.state is HandleState.UNSHARDED:
            unit._end_use(free=unit._should_free_in_backward())

    def use_sharded_views(self, unit) -> None:
        """Between uses: each original, registered again in the flat parameter's order (a tied weight's second
        name last, as torch FSDP1's), is a 1-D view of its piece of the local shard."""
        h = unit._handle
        h.module._parameters.pop("_flat_param", None)  # the originals are what the module registers
        self.forward_views = None
        for slot, original in zip(h.layout.slots, self.originals):
            if slot.param is None:  # wrap time: the core took the originals over
                slot.param = original
        for slot in h.layout.slots + h.layout.shared:
            clear_tensor_attr(slot.module, slot.name)
        for slot, (lo, hi) in zip(h.layout.slots, local_pieces(h)):
            slot.param.data = _piece(h, slot, lo, hi)
            slot.module._parameters[slot.name] = slot.param
        for sh in h.layout.shared:
            sh.module._parameters[sh.name] = h.layout.slots[sh.primary].param

    def after_unshard(self, unit) -> None:
        h = unit._handle
        if unit.training_state is TrainingState.SUMMON_FULL_PARAMS:  # the originals themselves, full .data
            for slot, v in zip(h.layout.slots, unflatten(h.unsharded.detach(), h.layout)):
                slot.module._parameters[slot.name] = slot.param
                slot.param.data = v
            for sh in h.layout.shared:
                sh.module._parameters[sh.name] = h.layout.slots[sh.primary].param
            return
        if unit.training_state is TrainingState.PRE_BACKWARD and all(s.param.grad is None for s in h.layout.slots):
            h.flat_param.grad = None  # the optimizer's zero_grad() reached the originals: the flat gradient too
        self.use_unsharded_views(unit, registered=unit.training_state is TrainingState.FORWARD)

    @torch.enable_grad()  # as the core's (torch's _use_unsharded_views too): a prefetch may run under no_grad
    def use_unsharded_views(self, unit, registered: bool) -> None:
        """Views of the full buffer (a frozen original's too, in autograd: Note (frozen originals)); in the forward
        registered too, so that
        ``named_parameters()`` inside it yields them (full shapes, plain tensors), as torch's.

        Note (the backward's views): the pre-backward runs inside autograd, where a new view has no graph; a
        reentrant checkpoint (``CheckpointImpl.REENTRANT``) recomputes its block there from what the names point
        at, and its gradient reaches the flat parameter only through a view made in the forward.  So the backward
        reuses the forward's view tensors, their ``.data`` the gathered buffer again, as torch's
        ``_use_unsharded_views`` does with ``flat_param._tensors`` (``tests/test_fsdp_checkpointing_parity.py``)."""
        h = unit._handle
        if not registered and self.graph_views is not None:
            views = self.graph_views
            for v, fresh in zip(views, unflatten(h.unsharded.detach(), h.layout), strict=True):
                v.data = fresh
        else:
            views = unflatten(h.view_source(), h.layout)  # (under MixedPrecision, core/handle.py's _OneCall)
            self.graph_views = views if registered else None
        self.forward_views = []
        for slot, v in zip(h.layout.slots, views):  # a frozen one's too: not detached, as torch's
            set_tensor_attr(slot.module, slot.name, v)
            self.forward_views.append(v)
            if registered:
                slot.module._parameters[slot.name] = v
        for sh in h.layout.shared:
            set_tensor_attr(sh.module, sh.name, views[sh.primary])
            if registered:
                sh.module._parameters[sh.name] = views[sh.primary]

    # ------------------------------------------------------------------ the user's changes, before each gather
    def before_unshard(self, unit, prefetch: bool) -> None:
        self.backward_prefetched = prefetch and unit.training_state is not TrainingState.FORWARD
        self.write_back_originals(unit)
        if unit.training_state is TrainingState.FORWARD:  # the core points the names at plain views next:
            h = unit._handle  # they leave _parameters (after_unshard registers the views in their place)
            for slot in h.layout.slots + h.layout.shared:
                slot.module._parameters.pop(slot.name, None)

    def write_back_originals(self, unit) -> None:
        """Copy into the flat shard (and flat gradient) every original the user gave new storage since the
        last use, or replaced by a new ``nn.Parameter``; raise where torch FSDP1 raises (its
        ``_writeback_orig_params``)."""
        h = unit._handle
        if self.forward_views is not None and _keeps_views_after_forward(unit):
            for slot, v in zip(h.layout.slots, self.forward_views, strict=True):
                now = getattr(slot.module, slot.name)
                if now is not v or not _same_storage(now, h.unsharded):
                    raise AssertionError(
                        f"FSDP does not support changing the parameters between forward and backward for "
                        f"{unit.sharding_strategy} ({slot.fqn!r} changed; torch FSDP1 raises this too). Change "
                        "parameters after the backward, or use FULL_SHARD, which reshards after the forward.")
            return
        flat = h.flat_param
        for slot, (lo, hi) in zip(h.layout.slots, local_pieces(h), strict=True):
            now = slot.module._parameters.get(slot.name)
            if hi <= lo or now is None:
                continue  # none of it on this rank, or deregistered for now (activation checkpointing)
            if now is not slot.param:
                slot.param = now  # a new Parameter under the name is the original from now on
            if not _same_storage(now, flat):
                flat.data[lo:hi].copy_(_checked(now.detach(), hi - lo, h.sharded, slot.fqn, "parameter"))
                now.data = _piece(h, slot, lo, hi)
            if h.gradient.state is GradState.SHARD:  # (no_sync: the grads are views of the full gradient)
                _write_back_grad(h, slot, lo, hi)
        for sh in h.layout.shared:
            if sh.module._parameters.get(sh.name) is not h.layout.slots[sh.primary].param:
                raise NotImplementedError(f"Changing shared parameters is not supported ({sh.fqn!r} no longer "
                                          "is the parameter it was tied to; torch FSDP1 raises this too).")

    # ------------------------------------------------------------------ gradients
    def after_reduce(self, unit) -> None:
        """The originals' ``.grad``: views of the full gradient kept by no_sync, else of this rank's shard."""
        h = unit._handle
        if not unit._sync_gradients:  # no_sync kept the full gradient (if this backward made one)
            if h.gradient.state is GradState.UNSHARDED:
                for slot, v in zip(h.layout.slots, unflatten(h.flat_param.grad, h.layout)):
                    if slot.param.requires_grad:  # now: a parameter frozen after wrapping gets none
                        set_grad(slot.param, v)
            return
        if h.flat_param.grad is None:
            return
        for slot, (lo, hi) in zip(h.layout.slots, local_pieces(h)):
            # as torch: no gradient where this rank holds none of the parameter, nor for one frozen now
            if slot.param.requires_grad and hi > lo:
                set_grad(slot.param, h.flat_param.grad[lo:hi].view(slot.param.shape))
            else:
                slot.param.grad = None
        _step_in_backward(h)


def _write_back_grad(h, slot, lo: int, hi: int) -> None:
    flat, g = h.flat_param, slot.param.grad
    if g is None:
        if flat.grad is not None:
            flat.grad[lo:hi].zero_()  # as torch: a gradient set to None is zeros in the flat gradient
        return
    if flat.grad is not None and _same_storage(g, flat.grad):
        return
    if flat.grad is None:
        flat.grad = torch.zeros_like(flat)
    flat.grad[lo:hi].copy_(_checked(g, hi - lo, h.sharded, slot.fqn, "gradient"))
    set_grad(slot.param, flat.grad[lo:hi].view(slot.param.shape))


def _step_in_backward(h) -> None:
    """``torch.distributed.optim._apply_optimizer_in_backward``: an original carrying ``_in_backward_optimizers``
    is stepped as soon as its gradient shard is here, and its gradient dropped, as torch FSDP1's post-backward;
    the flat gradient goes once no original holds one."""
    slots, stepped = h.layout.slots, False
    for slot in slots:
        optims = getattr(slot.param, "_in_backward_optimizers", None)
        if optims and slot.param.grad is not None:
            for opt in optims:
                opt.step()
                opt.zero_grad(set_to_none=True)
            stepped = True
    if stepped and all(slot.param.grad is None for slot in slots):
        h.flat_param.grad = None


# ---------------------------------------------------------------------- summon_full_params(with_grads=True)
def show_full_grads(h) -> tuple | None:
    """Each original's ``.grad`` becomes its full gradient (collective: the shards' gradients all-gathered,
    zeros for a rank that has none; None everywhere if no rank has one, as torch).  Returns the shards'
    gradients and the full one, for :func:`restore_grads`.  NO_SHARD: the gradients are whole already, views
    of the flat gradient, and stay so (an edit inside is kept, as torch)."""
    if not h.sharded:
        return None
    before = [s.param.grad for s in h.layout.slots]
    pieces = local_pieces(h)
    kept = [s.fqn for s, (lo, hi), g in zip(h.layout.slots, pieces, before, strict=True)
            if g is not None and g.numel() != max(hi - lo, 0)]
    if kept:  # (AssertionError: the type torch raises here, `_p_assert` "Expects tensor to be sharded")
        raise AssertionError(
            f"summon_full_params(with_grads=True) found whole gradients ({', '.join(kept[:3])}): a backward under "
            "no_sync() keeps each gradient whole until a synced backward reduces it, and with_grads gathers "
            "shards. Run the last micro-batch's backward outside no_sync() first, or read p.grad without with_grads.")
    local = torch.zeros(h.layout.shard_numel, dtype=h.flat_param.dtype, device=h.flat_param.device)
    for (lo, hi), g in zip(pieces, before, strict=True):
        if g is not None and hi > lo:
            local[lo:hi] = g.reshape(-1)
    # how many ranks have none (torch's int32 count, compared with the group's size)
    none = torch.tensor([int(all(g is None for g in before))], dtype=torch.int32, device=local.device)
    h.comm.all_reduce(none, group=h.groups.shard, async_op=True).wait()
    if none.item() == h.layout.world_size:
        return before, None
    full = torch.empty(h.layout.padded_numel, dtype=local.dtype, device=local.device)
    h.comm.all_gather(full, local, group=h.groups.shard, async_op=True).wait()
    for slot, v in zip(h.layout.slots, unflatten(full[: h.layout.numel], h.layout), strict=True):
        slot.param.grad = v if slot.param.requires_grad else None
    return before, full


def drop_full_grads(h) -> None:
    """The full gradients off the originals, before their ``.data`` is the shard again (the two must agree in
    shape).  NO_SHARD's are views of the flat gradient and stay."""
    for slot in h.layout.slots if h.sharded else []:
        slot.param.grad = None


def restore_grads(h, saved: tuple | None, writeback: bool) -> None:
    """The shards' gradients back; with ``writeback``, first updated from the full gradient (an edit made
    inside summon is kept, as torch's ``_writeback_to_local_shard``)."""
    if saved is None:
        return
    before, full = saved
    start = h.layout.shard_range(h.rank)[0]
    for slot, g, (lo, hi) in zip(h.layout.slots, before, local_pieces(h), strict=True):
        if writeback and full is not None and g is not None and hi > lo:
            g.view(-1).copy_(full[start + lo:start + hi])
        slot.param.grad = g
