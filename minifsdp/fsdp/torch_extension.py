"""What torch FSDP1 does at the step's fixed points beyond the algorithm: :class:`TorchExtension`.

Every unit of ``minifsdp.FSDP`` carries one (``fully_sharded.py``); the core calls it at the
points ``core/extension.py`` lists:

    point            what it adds, as torch FSDP1
    on_wrap          ``ignored_modules`` / ``ignored_states``: their parameters stay out of the flat
                     parameter (and out of the checks), their buffers out of ``buffer_dtype``'s cast
                     (:data:`KEEP_DTYPE`); the wrap-time checks (``checks.py``): one device,
                     the same weights on every rank or ``sync_module_states``, a weight tied across units;
                     a unit mixing frozen and trainable parameters is refused unless ``use_orig_params``;
                     a mark on every original taken over (:data:`FLATTENED`, read by two checks)
    on_lazy_init     every unit agrees on ``use_orig_params`` and ``limit_all_gathers``; parameter offload
                     is refused (``torch_options.check_cpu_offload``); the units' dtypes are fixed from now on
    before_forward   (the root) ``requires_grad`` set by the user after wrapping is read again, as
                     torch's ``_reset_flat_param_grad_info_if_needed``; a forward again before the
                     previous one's backward, after the shards changed, is refused
    before_unshard   ``model.half()`` / ``.to(dtype)`` after wrapping (``dtype_change.py``): before the
                     first forward the all-gather follows the new dtype, after it the change is torch's error
    after_forward    (the root) the shards' versions at a forward that awaits its backward
    after_backward   (the root) forgets them
"""

from __future__ import annotations

import torch
from torch.distributed.utils import _apply_to_tensors

from minifsdp.fsdp import pitfalls
from minifsdp.fsdp.checks import (
    FLATTENED,
    Flattened,
    check_one_device,
    check_same_on_all_ranks,
    check_ties_across_units,
)
from minifsdp.fsdp.core.extension import Extension
from minifsdp.fsdp.core.flat_param import build_layout
from minifsdp.fsdp.core.handle import HandleState
from minifsdp.fsdp.core.mixed_precision import KEEP_DTYPE, resolve_dtypes
from minifsdp.fsdp.core.units import units
from minifsdp.fsdp.deferred_init import sync_module_states
from minifsdp.fsdp.torch_options import check_cpu_offload, check_homogeneous

__all__ = ["TorchExtension", "adopt_dtype", "check_dtype"]


def _flattened_by_a_sibling(p) -> bool:
    """An original another unit took over and trains as itself (use_orig_params), reached again through a module
    of this one (a weight tied across units under NO_SHARD): torch's ``_get_orig_params`` skips it
    (``_is_fsdp_flattened``), and so do we; this unit's module keeps it (``checks.check_ties_across_units``)."""
    mark = getattr(p, FLATTENED, None)
    return mark is not None and mark.still_trains


class TorchExtension(Extension):
    """torch FSDP1's behaviour around the step, for one unit (the table above)."""

    def __init__(self, ignored_modules=frozenset(), ignored_params=frozenset(), sync_states: bool = False,
                 use_orig_params: bool = False):
        self.ignored_modules, self.ignored_params = ignored_modules, ignored_params
        self.sync_states, self.use_orig_params = sync_states, use_orig_params
        self.dtype_fixed = False  # set at the root's first forward (torch's lazy init)
        self.versions_at_forward = None  # the root's: shard versions at a forward that awaits its backward

    # ------------------------------------------------------------------ wrap
    def on_wrap(self, unit, layout):
        module = unit.module
        check_ties_across_units(module, self.use_orig_params)
        params = [s.param for s in layout.slots] if layout is not None else []
        kept = [p for p in params if p not in self.ignored_params and not _flattened_by_a_sibling(p)]
        ignored_buffers = {id(b) for m in self.ignored_modules for b in m.buffers()}
        for b in (b for m in self.ignored_modules for b in m.buffers()):  # MixedPrecision leaves them as they are
            setattr(b, KEEP_DTYPE, True)
        nested = {id(b) for m in units(module) for b in m.buffers()}
        buffers = [b for b in module.buffers() if id(b) not in nested and id(b) not in ignored_buffers]
        check_one_device(module, kept, buffers)
        if self.sync_states:
            sync_module_states(unit.groups, module, kept, buffers)  # shapes checked first
        else:
            pitfalls.check_same_unit_on_all_ranks(unit.groups, module, kept, buffers)  # ch 6: named, not hung
            check_same_on_all_ranks(unit.groups, module, kept, buffers)
        if not kept:
            return None
        if len(kept) < len(params):
            layout = build_layout(module, kept, layout.world_size)
        frozen = [s.fqn for s in layout.slots if not s.requires_grad]
        if not self.use_orig_params and 0 < len(frozen) < len(layout.slots):
            raise ValueError(f"FSDP unit mixes frozen ({', '.join(frozen)[:80]}...) and trainable parameters; one "
                             "flat parameter has one requires_grad (torch: 'Must flatten tensors with uniform "
                             "requires_grad when use_orig_params=False'). Pass use_orig_params=True, or wrap the "
                             "frozen part in its own unit.")
        for slot in layout.slots:
            setattr(slot.param, FLATTENED, Flattened(slot.module, slot.name, slot.fqn, self.use_orig_params,
                                                       unit.plan.shards_params, unit.plan.data_parallel_size))
        return layout

    # ------------------------------------------------------------------ the root's first forward
    def on_lazy_init(self, root) -> None:
        check_homogeneous(root._root_state.units)
        for unit in root._root_state.units:  # where torch fails on a CPU-only machine, after its own checks
            check_cpu_offload(getattr(unit, "cpu_offload", None))
        for unit in root._root_state.units:  # torch's lazy init: the dtypes are fixed from now on
            ext = _own(unit)
            if unit._handle is not None and ext is not None:
                adopt_dtype(unit._handle)
                ext.dtype_fixed = True

    # ------------------------------------------------------------------ each forward
    def before_forward(self, unit, args, kwargs) -> None:
        if not unit.is_root:
            return
        inside = unit._root_state.units
        for u in inside:  # requires_grad set by the user after wrapping: what the optimizer steps says
            h = u._handle
            if h is not None:
                rg = any(p.requires_grad for p in h.optimizer_params())
                for t in (h.flat_param, h.unsharded):
                    if t.requires_grad != rg:
                        t.requires_grad_(rg)
        if self.versions_at_forward is not None and torch.is_grad_enabled() \
                and self.versions_at_forward != _shard_versions(inside):
            raise RuntimeError(
                "FSDP: forward called again before the backward of the previous forward, and the sharded "
                "parameters changed in between (an optimizer step?). That backward would see the new "
                "parameters. Call backward on the previous output before stepping, or run forwards you "
                "do not differentiate under torch.no_grad().")

    def before_unshard(self, unit, prefetch: bool) -> None:
        h = unit._handle
        if self.dtype_fixed and h.frees:
            check_dtype(h)  # model.half() after the first forward: torch's error
        else:
            adopt_dtype(h)  # model.half() before it: gather (and compute) in the new dtype

    def after_forward(self, unit, output) -> None:
        grads = []  # whether each output tensor needs a gradient, in the core's walk (flags: see its hooks)
        _apply_to_tensors(lambda t: grads.append(t.requires_grad) or t, output)
        if unit.is_root and torch.is_grad_enabled() and any(grads):
            self.versions_at_forward = _shard_versions(unit._root_state.units)

    def after_backward(self, unit) -> None:
        self.versions_at_forward = None


def _own(unit) -> TorchExtension | None:
    return next((e for e in getattr(unit, "_extensions", ()) if isinstance(e, TorchExtension)), None)


def _shard_versions(inside: list) -> list[tuple[int, ...]]:
    return [u._handle.shard_version() for u in inside if u._handle is not None]


def adopt_dtype(h) -> None:
    """Before the root's first forward: the unit's dtypes and gather buffer follow the flat parameter's
    dtype now (it changed if ``model.half()`` ran since wrapping); the buffer must be freed."""
    new = h.flat_param.dtype
    if new == h.dtypes.orig or (h.frees and h.state is not HandleState.SHARDED):
        return
    h.dtypes = resolve_dtypes(h.mixed_precision, new)
    if h.frees:
        h.padded = h.new_full_buffer()  # the same autograd leaf: its hook stays


def check_dtype(h) -> None:
    """After the root's first forward: a flat parameter converted since cannot be gathered (torch's error)."""
    if h.flat_param.dtype != h.dtypes.orig:
        raise ValueError(
            f"Invalid usage of tensors with different dtypes: FSDP unit {h.name!r} was set up for "
            f"{h.dtypes.orig} at its first forward, and its sharded parameters are {h.flat_param.dtype} "
            "now (model.half() / .to(dtype) / .double() after the first forward; torch FSDP1 raises this "
            "ValueError too). Convert the model before its first forward, or compute in a lower precision "
            "with mixed_precision=MixedPrecision(param_dtype=...).")

