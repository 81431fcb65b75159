"""The one interface the layer above plugs into the core by: a :class:`Plugin`, called at six fixed points.

The core shards a parameter one way (rows, on the compute device), gathers one way (one dtype, one input per
parameter) and reduces one way (reduce-scatter, divide).  What torch's ``fully_shard`` offers beyond that is
built above the core, as plugins a group holds in ``group.plugins`` and calls, in list order, at these points
(each is a place where torch's own code branches for those features)::

    point            called in                                  what a plugin may do there
    after_shard      FSDPParamGroup.__init__ (fully_shard)      re-cut or move a parameter's shard
    on_lazy_init     FSDPParamGroup.lazy_init (root's 1st fwd)  adopt tensors replaced since fully_shard
    all_gather       FSDPParamGroup.unshard                     gather another way (returns what ran)
    before_reshard   FSDPParamGroup.to_sharded                  keep something before the full buffers go
    before_reduce    foreach_reduce, before the copy-in         rewrite the full gradients (the list, in place)
    after_reduce     foreach_reduce, after the reduce-scatter   reduce further (in place); False: keep it, stop

The core never asks what a plugin is; it calls these methods, and a point that returns None leaves the core's work
as it is.  A plugin class may subclass :class:`Plugin` and define only the points it uses.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn as nn

__all__ = ["Plugin"]


class Plugin(Protocol):
    """What the layer above the core plugs into a parameter group.  ``group``: the
    :class:`~minifsdp.fsdp2.core.param_group.FSDPParamGroup` calling (read after this module)."""

    def after_shard(self, group, originals: list[nn.Parameter]) -> None:
        """The group's parameters were just cut into rows; ``originals``: the whole weights, in order."""

    def on_lazy_init(self, group) -> None:
        """The root's first forward, before any gather."""

    def all_gather(self, group) -> object | None:
        """Gather the group's parameters; return what ran, with a ``copy_out()`` that fills every parameter's
        ``unsharded_param`` (as :class:`~minifsdp.fsdp2.core.collectives.AllGatherResult`).  None: the core gathers."""

    def before_reshard(self, group) -> None:
        """The group is about to free its full buffers (``group.training_state`` says after which hook)."""

    def before_reduce(self, group, params: list, grads: list[torch.Tensor]) -> None:
        """The full gradients of ``params`` are about to be cut into rows for the reduce-scatter."""

    def after_reduce(self, group, reduced: torch.Tensor) -> bool | None:
        """``reduced``: this rank's row of the reduce-scatter, before the divide after it (change it in place).
        False: stop here (the plugin keeps the reduction for a later one; no gradient is set this time)."""
