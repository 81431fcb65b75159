"""A unit's module called while the unit is not running: a clear error, not silent drift (chapter 6).

FSDP gathers a unit's parameters, and hooks their gradient for the reduction, around the unit's *own*
forward.  A root that iterates a wrapped container instead of calling it skips that forward::

    self.blocks = nn.Sequential(b0, b1)     # one unit (a size policy wraps containers; ModuleWrapPolicy may)
    for b in self.blocks:                   # the unit's forward never runs: b0 and b1 are called directly
        h = b(h)

Its blocks then run on whatever the unit's names point at between steps.  Under a sharded strategy that is
the 1-D shard, and the forward fails inside a kernel ("mat2 must be a matrix", in torch and in ours).  Under
NO_SHARD it is the whole parameter, so the forward and the backward run, but no pre- or post-backward hook of
the unit fires: its gradient is never averaged, each rank steps on its own, and the replicas drift apart with
no error (torch FSDP1 does exactly that; so did ours, bit for bit).

:class:`CalledOutsideItsUnit` hooks each module that holds one of the unit's parameters (a forward pre-hook,
one Python call per module call) and refuses the call while the unit is IDLE (its forward not running, no
backward or ``summon_full_params`` under way), naming the unit and the fix.  A call that cannot go wrong
passes: under ``no_grad`` on whole parameters, or on one rank (nothing to average).
"""

from __future__ import annotations

import weakref

import torch

from minifsdp.fsdp.core.extension import Extension
from minifsdp.fsdp.core.fsdp import TrainingState
from minifsdp.fsdp.core.handle import HandleState

__all__ = ["CalledOutsideItsUnit"]


class CalledOutsideItsUnit(Extension):
    """Hooks the modules holding the unit's parameters once, when the unit is first sharded (at wrap)."""

    def __init__(self):
        self.hooked = False

    def after_reshard(self, unit) -> None:
        if self.hooked or unit._handle is None:
            return
        self.hooked = True
        ref = weakref.ref(unit)  # the hook must not keep the unit alive
        owners = {id(s.module): s.module for s in unit._handle.layout.slots}
        for module in owners.values():
            module.register_forward_pre_hook(lambda mod, _args: _refuse_if_outside(ref(), mod))


def _refuse_if_outside(unit, module) -> None:
    if unit is None or unit.training_state is not TrainingState.IDLE:
        return
    h = unit._handle
    whole = h.state is HandleState.UNSHARDED
    averaged = unit.groups.data_parallel_size > 1 and torch.is_grad_enabled() and h.flat_param.requires_grad
    if whole and not averaged:
        return  # whole parameters, and no gradient that would need averaging: harmless
    what = ("its gradient would never be averaged: each rank would step on its own, and the replicas drift apart"
            if whole else "its parameters are this rank's 1-D shard between steps")
    raise RuntimeError(
        f"{type(module).__name__} inside FSDP unit {unit._handle.name!r} was called while that unit's forward is not "
        f"running: {what}. FSDP gathers a unit's parameters and hooks its gradient around the unit's own forward. "
        "Call the wrapped module itself (e.g. self.blocks(h), not `for b in self.blocks: h = b(h)`), or wrap each "
        "block as its own unit (ModuleWrapPolicy({Block}); size_based_auto_wrap_policy wraps an nn.Sequential).")
