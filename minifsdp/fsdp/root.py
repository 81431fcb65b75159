"""The root unit: the outermost FSDP unit, whose forward runs first, and what only it keeps.

    model = FSDP(TinyGPT(), auto_wrap_policy=...)     # root: the outer FSDP; units below it: the Blocks
    model(x, y)                                       # first forward: init_root(model) elects it

At its first forward the root (:func:`init_root`) lists every unit below it, tells
each one who its root is (a nested unit that ran forward on its own first is an
error), names their handles for the tracer, and casts floating-point buffers to
their unit's ``MixedPrecision.buffer_dtype`` once, remembering their own dtypes so
a state dict can give them back (as torch does).

Then, every step, the :class:`RootStep` holds the step's bookkeeping: the units'
execution order (``prefetch.py``), whether the final callback is queued, and the
shards' versions at the last forward awaiting a backward, so that an optimizer
step in between is caught (:func:`check_versions`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn

from minifsdp.fsdp.prefetch import ExecutionOrder
from minifsdp.fsdp.units import Unit, clean_name, units

__all__ = ["RootStep", "init_root", "shard_versions", "check_versions", "buffer_dtype_of"]


@dataclass
class RootStep:
    """What only the root keeps: every unit below it, the order they ran in, this step's bookkeeping."""

    units: list  # every unit under the root, the root first (units.units(root))
    order: ExecutionOrder = field(default_factory=ExecutionOrder)  # prefetch.py
    final_callback_queued: bool = False  # at most one final callback per backward
    versions_at_forward: list | None = None  # the shards' versions at the last forward that awaits a backward
    buffer_dtypes: dict = field(default_factory=dict)  # (id(module), name) -> dtype before buffer_dtype's cast


def init_root(root: Unit) -> RootStep:
    """Make ``root`` the root of every unit below it; returns its :class:`RootStep`."""
    step = RootStep(units(root))
    for name, unit in root.named_modules():
        if isinstance(unit, Unit) and unit._handle is not None:
            unit._handle.name = clean_name(name) or "root"
    for unit in step.units:
        if unit is not root and unit.is_root:
            raise RuntimeError("a nested FSDP unit ran forward on its own before its parent; "
                               "call the outermost FSDP module")
        unit.__dict__["_root"] = root  # a plain reference, not a registered submodule (no cycle)
    claimed = set()  # (id(module), name): a buffer takes its own (innermost) unit's buffer_dtype, or none
    for unit in reversed(step.units):  # innermost first
        mp = unit.mixed_precision
        for m in unit.module.modules():
            for name, b in m._buffers.items():
                if b is None or (id(m), name) in claimed:
                    continue
                claimed.add((id(m), name))
                if mp is not None and mp.buffer_dtype is not None and b.is_floating_point() \
                        and b.dtype != mp.buffer_dtype:
                    step.buffer_dtypes[(id(m), name)] = b.dtype
                    m._buffers[name] = b.to(mp.buffer_dtype)
    return step


def buffer_dtype_of(root: nn.Module, module: nn.Module, name: str, buffer: torch.Tensor) -> torch.dtype:
    """The dtype ``module.<name>`` had before mixed precision cast it (its current dtype if never cast)."""
    step = getattr(root, "_root_step", None)
    if step is None:
        return buffer.dtype
    return step.buffer_dtypes.get((id(module), name), buffer.dtype)


def shard_versions(step: RootStep) -> list[tuple[int, ...]]:
    """Each local shard's version counters (``FlatParamHandle.shard_version``): an optimizer step bumps them."""
    return [u._handle.shard_version() for u in step.units if u._handle is not None]


def check_versions(step: RootStep) -> None:
    """At a root forward: refuse if the shards changed since a forward whose backward has not run yet."""
    if step.versions_at_forward is not None and step.versions_at_forward != shard_versions(step):
        raise RuntimeError(
            "FSDP: forward called again before the backward of the previous forward, and the sharded "
            "parameters changed in between (an optimizer step?). That backward would see the new "
            "parameters. Call backward on the previous output before stepping, or run forwards you "
            "do not differentiate under torch.no_grad()."
        )
