"""Chapter 5: ``reshard_after_forward=k`` (an int), resharding to a smaller group after forward, as torch's.

After forward a group normally frees its full parameters and keeps 1/N (its shard); backward gathers them again
from all N ranks.  With an int k (dividing N), each rank keeps 1/k of the full parameters instead, and backward's
all-gather runs inside a group of k consecutive ranks (e.g. the GPUs of one node, on its fast links)::

    N = 4, k = 2: after forward rank r keeps piece (r mod 2) of each full buffer, cut in 2 flat pieces
    ranks (0, 1) and (2, 3) each hold one whole copy between them; backward gathers within the pair
    memory between forward and backward: 1/2 of the group's full size instead of 1/4; after backward: 1/4

:class:`ReshardToGroup` plugs in where the core reshards (``before_reshard``: after a forward, keep this rank's
piece before the full buffers are freed) and where it gathers (``all_gather``: if pieces are held, gather them
within the k ranks; :mod:`minifsdp.fsdp2.core.plugin`).  Every other reshard drops the pieces.  The pieces are
flat slices of the full buffer, so gathering them refills it as it was.  Not built here, as in torch: with
all-gather extensions.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from minifsdp.fsdp2.core import Plugin, TrainingState, foreach_all_gather
from minifsdp.fsdp2.extensions import sharded_local

__all__ = ["ReshardToGroup"]


class ReshardToGroup(Plugin):
    """The plugin for an int ``reshard_after_forward``: ``subgroup`` is this rank's k consecutive ranks."""

    def __init__(self, subgroup):
        self.subgroup = subgroup
        self.pieces: list[torch.Tensor] | None = None  # held between a forward and the next gather

    def before_reshard(self, group) -> None:
        if group.training_state is not TrainingState.FORWARD:
            self.pieces = None
            return
        if not group.is_unsharded:
            return
        if any(hasattr(sharded_local(p), "fsdp_pre_all_gather") for p in group.fsdp_params):
            raise NotImplementedError("fully_shard: an int reshard_after_forward with all-gather extensions")
        parts, index = dist.get_world_size(self.subgroup), dist.get_rank(self.subgroup)
        self.pieces = [p.full_padded.view(parts, -1)[index].clone() for p in group.fsdp_params]

    def all_gather(self, group):
        if self.pieces is None:
            return None
        pieces, self.pieces = self.pieces, None
        return foreach_all_gather(group.fsdp_params, pieces, pieces[0].dtype, group.comm, self.subgroup,
                                  dist.get_rank(self.subgroup), dist.get_world_size(self.subgroup))
