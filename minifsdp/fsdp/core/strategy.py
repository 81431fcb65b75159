"""Sharding strategies (chapter 2.1), the process groups they use, and how a gradient is averaged.

    strategy       parameters between uses    gradient reduction           ZeRO stage
    FULL_SHARD     sharded (freed after fwd)  reduce-scatter               3
    SHARD_GRAD_OP  kept from fwd to bwd       reduce-scatter               2
    NO_SHARD       whole on every rank        all-reduce (DDP-like)        -
    HYBRID_SHARD   sharded inside a group,    reduce-scatter in the group  3 in the group
                   replicated across groups   + all-reduce across groups
    _HYBRID_SHARD_ZERO2  HYBRID_SHARD, but parameters kept from fwd to bwd (torch's private name)

HYBRID_SHARD on 4 ranks as a 2 x 2 mesh (replicate dimension first, shard second):

                 shard dim ->
    replicate    rank 0  rank 1      shard groups:     {0, 1}  {2, 3}
    dim  |       rank 2  rank 3      replicate groups: {0, 2}  {1, 3}
         v
    rank 0 and rank 2 hold the same shard; ranks 0 and 1 together hold a whole unit.

Note (gradient averaging, bitwise as torch FSDP1): torch does not divide the summed
gradient by N once.  With ``f = predivide_factor(N)`` (the smallest power of two with
``f * f >= N``, stopping early if f stops dividing N) it divides each rank's gradient by
``f`` *before* the sum and the result by ``N / f`` after (``_init_utils.py``,
``_runtime_utils.py``), which keeps fp16 sums from overflowing or underflowing.
N = 2: /2 before; N = 4: /2 before, /2 after; N = 3: /2 before, /1.5 after.  For
HYBRID_SHARD, N is the whole data-parallel size (shard x replicate).
"""

from dataclasses import dataclass
from enum import Enum, auto

import torch
import torch.distributed as dist
import torch.nn.functional as F


class ShardingStrategy(Enum):
    FULL_SHARD = auto()
    SHARD_GRAD_OP = auto()
    NO_SHARD = auto()
    HYBRID_SHARD = auto()
    _HYBRID_SHARD_ZERO2 = auto()


HYBRID = (ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2)  # two groups: shard, replicate
SHARDED = (ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP, *HYBRID)
RESHARD_AFTER_FORWARD = (ShardingStrategy.FULL_SHARD, ShardingStrategy.HYBRID_SHARD)


def predivide_factor(world_size: int) -> float:
    """torch FSDP1's gradient pre-divide factor: double f while N % f == 0 and N / f > f."""
    factor = 1
    while world_size % factor == 0 and world_size / factor > factor:
        factor *= 2
    return float(factor)


def prepare_for_reduce_scatter(grad: torch.Tensor, padded_numel: int, reduce_dtype: torch.dtype,
                               predivide: float) -> torch.Tensor:
    """Each rank's reduce-scatter input, in torch FSDP1's order: cast, pad to ``padded_numel``, divide by
    ``f`` (in place on ``grad`` itself when no cast and no padding made a copy)."""
    if grad.dtype != reduce_dtype:
        grad = grad.to(reduce_dtype)
    pad = padded_numel - grad.numel()
    if pad > 0:
        grad = F.pad(grad, [0, pad])
    if predivide > 1:
        grad.div_(predivide)
    return grad


def finish_reduced_shard(shard: torch.Tensor, postdivide: float, dtype: torch.dtype) -> torch.Tensor:
    """After the reduce-scatter: divide the summed shard by ``N / f`` and cast it to ``dtype``."""
    if postdivide > 1:
        shard.div_(postdivide)
    return shard.to(dtype) if shard.dtype != dtype else shard


@dataclass
class ShardGroups:
    """``shard``: the ranks that split a unit; ``replicate``: ranks holding the same shard (HYBRID) or None."""

    shard: dist.ProcessGroup
    replicate: dist.ProcessGroup | None = None

    @property
    def shard_rank(self) -> int:
        return dist.get_rank(self.shard)

    @property
    def shard_size(self) -> int:
        return dist.get_world_size(self.shard)

    @property
    def data_parallel_size(self) -> int:
        return self.shard_size * (dist.get_world_size(self.replicate) if self.replicate is not None else 1)


def resolve_groups(strategy: ShardingStrategy, process_group) -> ShardGroups:
    """``process_group`` (a group, None for all ranks, or HYBRID's ``(shard, replicate)``) -> ShardGroups."""
    if strategy not in HYBRID:
        if isinstance(process_group, tuple):
            raise ValueError(f"a (shard_group, replicate_group) tuple is for HYBRID_SHARD, not {strategy.name}")
        return ShardGroups(process_group if process_group is not None else dist.group.WORLD)
    if not (isinstance(process_group, tuple) and len(process_group) == 2):
        raise ValueError(f"{strategy.name} needs its two groups: device_mesh=init_device_mesh(device, (replicate, "
                         "shard)) or process_group=(shard_group, replicate_group) (see minifsdp.hybrid_groups).")
    groups = ShardGroups(*process_group)
    if groups.data_parallel_size != dist.get_world_size():
        raise ValueError(f"{strategy.name}: shard group of {groups.shard_size} x replicate group of "
                         f"{dist.get_world_size(groups.replicate)} ranks = {groups.data_parallel_size}, but the world "
                         f"size is {dist.get_world_size()}; the groups must tile the world (e.g. 4 ranks = 2 x 2).")
    return groups
