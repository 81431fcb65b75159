"""The core's handle, plus what torch FSDP1's wider API asks of it.

:class:`~minifsdp.fsdp.core.handle.FlatParamHandle` is the algorithm.  The class users import
(``fully_sharded.py``) builds :class:`TorchHandle` instead, which adds:

* ``model.half()`` / ``.to(dtype)`` / ``.double()`` after wrapping (``dtype_change.py``): until
  the root's first forward, each all-gather first adopts the flat parameter's current dtype;
  after it, a changed dtype is torch's error;
* a mark on every original parameter it takes over (:data:`FLATTENED`), read by two wrap-time
  and step-time checks: a weight tied across units (``checks.check_ties_across_units``) and an
  optimizer built before wrapping (``checks.install_optimizer_check``);
* ``requires_grad`` set by the user after wrapping, read again at every root forward.

``use_orig_params=True`` is a subclass of this one: ``orig_params.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn as nn

from minifsdp.fsdp.core.handle import FlatParamHandle
from minifsdp.fsdp.core.mixed_precision import resolve_dtypes
from minifsdp.fsdp.core.state import HandleState

__all__ = ["TorchHandle", "FLATTENED", "Flattened"]

FLATTENED = "_minifsdp_flattened"  # the one attribute FSDP puts on an original parameter it took over


@dataclass
class Flattened:
    """Where an original parameter was flattened, and whether it still trains (``use_orig_params``)."""

    module: nn.Module
    name: str
    fqn: str
    still_trains: bool


class TorchHandle(FlatParamHandle):
    """A :class:`FlatParamHandle` that follows dtype changes and marks the originals it takes over."""

    use_orig_params = False  # True: the originals stay, views of the shard, stepped by the optimizer

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.dtype_fixed = False  # set at the root's first forward (torch's lazy init)

    def mark_originals(self) -> None:
        """Put :data:`FLATTENED` on each original parameter: where it went (read by the checks)."""
        for slot in self.layout.slots:
            setattr(slot.param, FLATTENED, Flattened(slot.module, slot.name, slot.fqn, self.use_orig_params))

    def take_over_params(self) -> None:
        self.mark_originals()
        super().take_over_params()

    def start_unshard(self, prefetch: bool = False) -> None:
        if self.dtype_fixed and self.frees:
            self.check_dtype()  # model.half() after the first forward: torch's error
        else:
            self.adopt_dtype()  # model.half() before it: gather (and compute) in the new dtype
        super().start_unshard(prefetch)

    def adopt_dtype(self) -> None:
        """Before the root's first forward: the unit's dtypes and gather buffer follow the flat parameter's
        dtype now (it changed if ``model.half()`` ran since wrapping); the buffer must be freed."""
        new = self.flat_param.dtype
        if new == self.dtypes.orig or (self.frees and self.state is not HandleState.SHARDED):
            return
        self.dtypes = resolve_dtypes(self.mixed_precision, new)
        if self.frees:
            self.padded = self.new_full_buffer()  # the same autograd leaf: its hook stays

    def fix_dtype(self) -> None:
        """The root's first forward: adopt the dtype one last time; from now on a change is an error."""
        self.adopt_dtype()
        self.dtype_fixed = True

    def check_dtype(self) -> None:
        """After the root's first forward: a flat parameter converted since cannot be gathered (torch's error)."""
        if self.flat_param.dtype != self.dtypes.orig:
            raise ValueError(
                f"Invalid usage of tensors with different dtypes: FSDP unit {self.name!r} was set up for "
                f"{self.dtypes.orig} at its first forward, and its sharded parameters are {self.flat_param.dtype} "
                "now (model.half() / .to(dtype) / .double() after the first forward; torch FSDP1 raises this "
                "ValueError too). Convert the model before its first forward, or compute in a lower precision "
                "with mixed_precision=MixedPrecision(param_dtype=...).")

    def requires_grad(self) -> bool:
        """Whether the unit computes a gradient: the flat parameter's own flag, the one users set."""
        return self.flat_param.requires_grad

    def refresh_requires_grad(self) -> None:
        """At every root forward: the flat parameter and the gradient leaf follow :meth:`requires_grad`.

        As torch's ``_reset_flat_param_grad_info_if_needed``: a unit frozen at wrapping and unfrozen
        later trains; with ``use_orig_params``, ``p.requires_grad_(False)`` after wrapping freezes ``p``.
        """
        rg = self.requires_grad()
        for t in (self.flat_param, self.unsharded):
            if t.requires_grad != rg:
                t.requires_grad_(rg)
