"""Chapter 5: what runs after a group's reduce-scatter: HSDP's all-reduce over the replicas, and the user's hook.

HSDP (a 2-D mesh ``(replicate, shard)``, torch's convention: dim 0 replicates, dim 1 shards): parameters are
sharded inside each shard group and the shard groups are copies of each other.  Gathers and reduce-scatters stay
inside the shard group; each reduced shard is then averaged over the ranks that hold the same rows::

    mesh (2, 2):   shard group {0, 1} and {2, 3}; replicate group {0, 2} and {1, 3}
    reduce-scatter in {0, 1}: rank 0 holds rows 0..c of the pair's average
    all-reduce in {0, 2}:     rank 0 and rank 2 average their rows 0..c: the gradient over all four ranks

:class:`Replicate` plugs in after the core's reduce-scatter (``after_reduce``, :mod:`minifsdp.fsdp2.core.plugin`).
With ``set_requires_all_reduce(False)`` it adds each micro-batch's reduced shard into a partial sum and stops the
step there (no ``.grad`` yet); the micro-batch that allows the all-reduce adds the partial sum first, as torch's.
The divide factors count both dims: ``MeshInfo.data_parallel_size`` is shard size times replicas.

:class:`AllReduceHook` (``set_all_reduce_hook(hook)``): the user's function called on each group's reduced shard,
after HSDP's all-reduce and before the divide after it (e.g. a custom all-reduce across another group).
"""

from __future__ import annotations

from typing import Callable

import torch

from minifsdp.fsdp2.core import Plugin, gradient_divide_factors

__all__ = ["Replicate", "AllReduceHook"]


class Replicate(Plugin):
    """The plugin for HSDP: all-reduce each reduced shard over ``replicate_group``."""

    def __init__(self, replicate_group):
        self.replicate_group = replicate_group
        self.all_reduce_grads = True  # set_requires_all_reduce
        self.partial: torch.Tensor | None = None  # micro-batches' reduced shards, waiting for their all-reduce

    def after_reduce(self, group, reduced: torch.Tensor) -> bool:
        if not self.all_reduce_grads:
            self.partial = reduced if self.partial is None else self.partial + reduced
            return False
        if self.partial is not None:
            reduced += self.partial
            self.partial = None
        *_, op = gradient_divide_factors(group.world_size, group.data_parallel_size, reduced.dtype,
                                         group.gradient_divide_factor, group.force_sum_reduction_for_comms)
        group.comm.all_reduce(reduced, op=op, group=self.replicate_group)
        return True


class AllReduceHook(Plugin):
    """The plugin for ``set_all_reduce_hook``: ``hook(reduced)`` on each reduced shard."""

    def __init__(self, hook: Callable[[torch.Tensor], None]):
        self.hook = hook

    def after_reduce(self, group, reduced: torch.Tensor) -> bool:
        self.hook(reduced)
        return True
