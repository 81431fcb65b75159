"""``use_orig_params=True``: the original parameters stay, as views of the flat shard.

torch FSDP1's flag.  With it the optimizer steps the *original* parameters (each a 1-D piece
of the local shard, or the whole tensor under NO_SHARD) instead of one flat parameter, so
optimizer parameter groups, frozen parameters inside a unit, and per-parameter learning
rates work as on the plain model.  The algorithm is the core's (``core/handle.py``,
``core/gradient.py``); what changes is where each name points, chosen once at wrap time by
building an :class:`OrigParamHandle`:

    moment              use_orig_params=False (core)           use_orig_params=True (here)
    between uses        names are empty tensors; the module   names are the originals, registered,
                        registers ``_flat_param``              ``.data`` = their piece of the shard
    forward             names are views of the full buffer     the same, and registered (so
                                                               named_parameters() shows them)
    backward            (the forward's views)                  views again (a recompute reads them)
    gradient            ``flat_param.grad`` (the shard)        each original's ``.grad`` = its piece
    summon              new full-shape Parameters              the originals, ``.data`` = full view

Note (alignment): torch aligns each original to 16 bytes in the flat buffer when
``use_orig_params=True``, so each piece is a valid tensor start; so do we (``align_numel``).

Note (frozen originals): a unit may mix frozen and trainable originals; a frozen one's view
is detached, gets no gradient, and the optimizer skips it.  ``p.requires_grad_(False)``
after wrapping works too (read again at every root forward).

Note (write-back, as torch's ``_writeback_orig_params``): between steps a user may give an original
new storage (``p.data = t``, ``p.grad = g``) or put a new ``nn.Parameter`` under its name.  Before every
all-gather the handle copies such a tensor into the flat shard (and a gradient into the flat gradient),
so the all-gather sends what the user sees; a piece of another shape is an error.  SHARD_GRAD_OP keeps
the forward's full-shape views until the backward (torch's "skipped sharded views"): changing them in
between is an error too.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from minifsdp.fsdp.core.flat_param import unflatten
from minifsdp.fsdp.core.gradient import UnitGradient, set_grad
from minifsdp.fsdp.core.state import GradState
from minifsdp.fsdp.core.strategy import ShardingStrategy
from minifsdp.fsdp.torch_handle import TorchHandle

__all__ = ["OrigParamHandle", "OrigParamGradient", "set_tensor_attr", "clear_tensor_attr"]


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


KEEPS_VIEWS_AFTER_FORWARD = (ShardingStrategy.SHARD_GRAD_OP, ShardingStrategy._HYBRID_SHARD_ZERO2)


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


class OrigParamGradient(UnitGradient):
    """The gradient of an :class:`OrigParamHandle`: the originals' ``.grad`` are where users look."""

    def prepare(self) -> None:
        h, slots = self.handle, self.handle.layout.slots
        if self.state is GradState.UNSHARDED and all(s.param.grad is None for s in slots if s.param.requires_grad):
            self.state = GradState.SHARD  # the optimizer's zero_grad() discarded the no_sync gradient
            h.unsharded.grad = None
        if all(s.param.grad is None for s in slots):
            h.flat_param.grad = None

    def keep_unsharded(self) -> None:
        h = self.handle
        g = self.take_cast_grad() if h.casts_unsharded else h.unsharded.grad
        if g is None:
            return
        for slot, v in zip(h.layout.slots, unflatten(g, h.layout)):
            if slot.param.requires_grad:  # now: a parameter frozen after wrapping gets none
                set_grad(slot.param, v)
        self.state = GradState.UNSHARDED

    def finish_reduce(self) -> None:
        if self.in_flight is None:
            return
        super().finish_reduce()
        h = self.handle
        if h.flat_param.grad is None:
            return
        for slot, (lo, hi) in zip(h.layout.slots, h.local_pieces()):
            # as torch: no gradient where this rank holds none of the parameter, nor for one frozen now
            if slot.param.requires_grad and hi > lo:
                set_grad(slot.param, h.flat_param.grad[lo:hi].view(slot.param.shape))
            else:
                slot.param.grad = None
        self._step_in_backward()

    def _step_in_backward(self) -> None:
        """``torch.distributed.optim._apply_optimizer_in_backward``: an original carrying
        ``_in_backward_optimizers`` is stepped as soon as its gradient shard is here, and its gradient
        dropped, as torch FSDP1's post-backward; the flat gradient goes once no original holds one."""
        slots, stepped = self.handle.layout.slots, False
        for slot in slots:
            optims = getattr(slot.param, "_in_backward_optimizers", None)
            if optims and slot.param.grad is not None:
                for opt in optims:
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                stepped = True
        if stepped and all(slot.param.grad is None for slot in slots):
            self.handle.flat_param.grad = None


class OrigParamHandle(TorchHandle):
    """A handle whose module names stay the original parameters (views of the shard between uses)."""

    use_orig_params = True

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.gradient = OrigParamGradient(self)
        self.forward_views = None  # SHARD_GRAD_OP after a forward with grad: the full views the names still are

    def take_over_params(self) -> None:
        """The originals stay, their ``.data`` a view of this rank's shard; each module registers its own
        again in the flat parameter's order, a tied weight's second name last, as torch FSDP1's."""
        self.mark_originals()
        for sh in self.layout.shared:
            sh.module._parameters.pop(sh.name, None)
        for slot in self.layout.slots:
            slot.module._parameters.pop(slot.name, None)
        self.use_sharded_views()

    def optimizer_params(self) -> list[nn.Parameter]:
        return [slot.param for slot in self.layout.slots]

    def shard_version(self) -> tuple[int, ...]:
        """The optimizer steps the originals (views made by ``.data =``, with counters of their own): read those."""
        return (self.flat_param._version, *(s.param._version for s in self.layout.slots))

    def requires_grad(self) -> bool:
        return any(s.param.requires_grad for s in self.layout.slots)

    def use_unsharded_views(self, in_forward: bool = False) -> None:
        """Views of the full buffer (a frozen original's detached); in the forward registered too, so that
        ``named_parameters()`` inside it yields them (full shapes, plain tensors), as torch's."""
        views = unflatten(self.unsharded, self.layout)
        self.forward_views = []
        for slot, v in zip(self.layout.slots, views):
            if not slot.param.requires_grad:
                v = v.detach()
            set_tensor_attr(slot.module, slot.name, v)
            self.forward_views.append(v)
            if in_forward:
                slot.module._parameters[slot.name] = v
        for sh in self.layout.shared:
            set_tensor_attr(sh.module, sh.name, views[sh.primary])
            if in_forward:
                sh.module._parameters[sh.name] = views[sh.primary]

    def use_sharded_views(self) -> None:
        """Between uses: each original, registered again, is a 1-D view of its piece of the local shard."""
        self.forward_views = None
        for slot in self.layout.slots + self.layout.shared:
            clear_tensor_attr(slot.module, slot.name)
        for slot, (lo, hi) in zip(self.layout.slots, self.local_pieces()):
            slot.param.data = self._piece(slot, lo, hi)
            slot.module._parameters[slot.name] = slot.param
        for sh in self.layout.shared:
            sh.module._parameters[sh.name] = self.layout.slots[sh.primary].param

    def _piece(self, slot, lo: int, hi: int) -> torch.Tensor:
        """An original's view of the local shard: 1-D when sharded, its own shape under NO_SHARD."""
        piece = self.flat_param.data[lo:hi]
        return piece if self.sharded else piece.view(slot.shape)

    def after_forward(self) -> None:
        """As torch: a unit that keeps its full parameters after the forward (SHARD_GRAD_OP) with autograd on
        keeps the forward's views too, so ``p.shape`` is the full shape until the backward."""
        if torch.is_grad_enabled() and self.strategy in KEEPS_VIEWS_AFTER_FORWARD:
            return
        self.use_sharded_views()

    def start_unshard(self, prefetch: bool = False) -> None:
        self.write_back_originals()
        super().start_unshard(prefetch)

    def write_back_originals(self) -> None:
        """Copy into the flat shard (and flat gradient) every original the user gave new storage since the
        last use, or replaced by a new ``nn.Parameter``; raise where torch FSDP1 raises."""
        if self.forward_views is not None and self.strategy in KEEPS_VIEWS_AFTER_FORWARD:
            for slot, v in zip(self.layout.slots, self.forward_views, strict=True):
                now = getattr(slot.module, slot.name)
                if now is not v or not _same_storage(now, self.unsharded):
                    raise AssertionError(
                        f"FSDP does not support changing the parameters between forward and backward for "
                        f"{self.strategy} ({slot.fqn!r} changed; torch FSDP1 raises this too). Change parameters "
                        "after the backward, or use FULL_SHARD, which reshards after the forward.")
            return
        flat = self.flat_param
        for slot, (lo, hi) in zip(self.layout.slots, self.local_pieces(), strict=True):
            now = slot.module._parameters.get(slot.name)
            if hi <= lo or now is None:
                continue  # none of it on this rank, or deregistered for now (activation checkpointing)
            if now is not slot.param:
                slot.param = now  # a new Parameter under the name is the original from now on
            if not _same_storage(now, flat):
                flat.data[lo:hi].copy_(_checked(now.detach(), hi - lo, self.sharded, slot.fqn, "parameter"))
                now.data = self._piece(slot, lo, hi)
            if self.gradient.state is GradState.SHARD:  # (no_sync: the grads are views of the full gradient)
                self._write_back_grad(slot, lo, hi)
        for sh in self.layout.shared:
            if sh.module._parameters.get(sh.name) is not self.layout.slots[sh.primary].param:
                raise NotImplementedError(f"Changing shared parameters is not supported ({sh.fqn!r} no longer "
                                          "is the parameter it was tied to; torch FSDP1 raises this too).")

    def _write_back_grad(self, slot, lo: int, hi: int) -> None:
        flat, g = self.flat_param, slot.param.grad
        if g is None:
            if flat.grad is not None:
                flat.grad[lo:hi].zero_()  # as torch: a gradient set to None is zeros in the flat gradient
            return
        if flat.grad is not None and _same_storage(g, flat.grad):
            return
        if flat.grad is None:
            flat.grad = torch.zeros_like(flat)
        flat.grad[lo:hi].copy_(_checked(g, hi - lo, self.sharded, slot.fqn, "gradient"))
        set_grad(slot.param, flat.grad[lo:hi].view(slot.param.shape))

    def before_backward(self) -> None:
        self.use_unsharded_views()

    def after_backward(self) -> None:
        self.use_sharded_views()

    def use_full_params(self) -> None:
        """summon_full_params: the originals themselves, their ``.data`` a view of the full buffer."""
        for slot, v in zip(self.layout.slots, unflatten(self.unsharded.detach(), self.layout)):
            slot.param.data = v

    def drop_full_params(self) -> None:
        self.use_sharded_views()

    def show_full_grads(self) -> tuple | None:
        """summon_full_params(with_grads=True): each original's ``.grad`` becomes its full gradient (collective:
        the shards' gradients all-gathered, zeros for a rank that has none; None everywhere if no rank has one,
        as torch).  Returns the shards' gradients and the full one, for :meth:`restore_grads`.  NO_SHARD: the
        gradients are whole already, views of the flat gradient, and stay so (an edit inside is kept, as torch)."""
        if not self.sharded:
            return None
        before = [s.param.grad for s in self.layout.slots]
        local = torch.zeros(self.layout.shard_numel, dtype=self.flat_param.dtype, device=self.flat_param.device)
        for (lo, hi), g in zip(self.local_pieces(), before, strict=True):
            if g is not None and hi > lo:
                local[lo:hi] = g.reshape(-1)
        has = torch.tensor([float(any(g is not None for g in before))], device=local.device)
        self.comm.all_reduce(has, group=self.groups.shard, async_op=True).wait()
        if has.item() == 0:
            return before, None
        full = torch.empty(self.layout.padded_numel, dtype=local.dtype, device=local.device)
        self.comm.all_gather(full, local, group=self.groups.shard, async_op=True).wait()
        for slot, v in zip(self.layout.slots, unflatten(full[: self.layout.numel], self.layout), strict=True):
            slot.param.grad = v if slot.param.requires_grad else None
        return before, full

    def restore_grads(self, saved: tuple | None, writeback: bool) -> None:
        """The shards' gradients back; with ``writeback``, first updated from the full gradient (an edit made
        inside summon is kept, as torch's ``_writeback_to_local_shard``)."""
        if saved is None:
            return
        before, full = saved
        start = self.layout.shard_range(self.rank)[0]
        for slot, g, (lo, hi) in zip(self.layout.slots, before, self.local_pieces(), strict=True):
            if writeback and full is not None and g is not None and hi > lo:
                g.view(-1).copy_(full[start + lo:start + hi])
            slot.param.grad = g
