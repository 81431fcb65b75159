"""Sharding strategies, the process groups they use, and how a gradient is reduced.

    strategy       parameters between uses    gradient reduction          ZeRO stage
    FULL_SHARD     sharded (freed after fwd)  reduce-scatter              3
    SHARD_GRAD_OP  kept from fwd to bwd       reduce-scatter              2
    NO_SHARD       whole on every rank        all-reduce (DDP-like)       -
    HYBRID_SHARD   sharded inside a group,    reduce-scatter in the group  3 in the group
                   replicated across groups   + all-reduce across groups
    _HYBRID_SHARD_ZERO2  as HYBRID_SHARD, but  as HYBRID_SHARD             2 in the group
                   kept from fwd to bwd (torch's private name: SHARD_GRAD_OP inside the group)

HYBRID_SHARD on 4 ranks as a 2 x 2 mesh (replicate dimension first, shard second):

                 shard dim ->
    replicate    rank 0  rank 1      shard groups:     {0, 1}  {2, 3}
    dim  |       rank 2  rank 3      replicate groups: {0, 2}  {1, 3}
         v
    rank 0 and rank 2 hold the same shard; ranks 0 and 1 together hold a whole unit.

Note (gradient averaging, bitwise as torch FSDP1): torch does not divide the
summed gradient by N once.  With ``f = predivide_factor(N)`` (the smallest power
of two with ``f * f >= N``, stopping early if f stops dividing N) it divides each rank's
gradient by ``f`` *before* the sum and the result by ``N / f`` after
(``torch/distributed/fsdp/_init_utils.py`` and ``_runtime_utils.py``), which keeps
fp16 sums from overflowing or underflowing.  N = 2: /2 before, none after;
N = 4: /2 before, /2 after.  We do the same, so our gradients are bitwise
torch's whenever the sum itself is performed in the same order.  For
HYBRID_SHARD, N is the whole data-parallel size (shard x replicate).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum, auto

import torch
import torch.distributed as dist
import torch.nn.functional as F

from minifsdp.comm.collectives import get_collectives

__all__ = ["ShardingStrategy", "HYBRID", "ShardGroups", "resolve_groups", "predivide_factor",
           "prepare_for_reduce_scatter", "finish_reduced_shard", "Comm", "hybrid_groups"]


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
    """Each rank's input to the reduce-scatter, in torch FSDP1's order: cast, pad, divide by ``f``.

    ``grad``: this rank's full 1-D gradient (``numel`` numbers); returns ``padded_numel``
    numbers in ``reduce_dtype``.  May divide ``grad`` itself in place when no cast and
    no padding is needed: pass a copy if the caller still needs it.
    """
    if grad.dtype != reduce_dtype:
        grad = grad.to(reduce_dtype)  # torch casts before padding and pre-dividing
    pad = padded_numel - grad.numel()
    if pad > 0:
        grad = F.pad(grad, [0, pad])
    if predivide > 1:
        grad.div_(predivide)
    return grad


def finish_reduced_shard(shard: torch.Tensor, postdivide: float, dtype: torch.dtype) -> torch.Tensor:
    """After the reduce-scatter: divide the summed shard by ``N / f`` and cast it to the parameter's dtype."""
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


def hybrid_groups(shard_size: int) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """(shard_group, replicate_group) for this rank, shards of ``shard_size`` consecutive ranks.

    Every rank must call it (``new_group`` is collective).  Same layout as
    ``init_device_mesh(device, (world // shard_size, shard_size))``.
    """
    world = dist.get_world_size()
    if shard_size < 1 or world % shard_size:
        raise ValueError(
            f"HYBRID_SHARD: world size {world} does not split into shard groups of {shard_size} ranks; "
            f"choose a shard size that divides {world}."
        )
    rank, mine = dist.get_rank(), {}
    for start in range(0, world, shard_size):  # shard groups: consecutive ranks
        g = dist.new_group(list(range(start, start + shard_size)))
        if start <= rank < start + shard_size:
            mine["shard"] = g
    for col in range(shard_size):  # replicate groups: same position in every shard group
        g = dist.new_group(list(range(col, world, shard_size)))
        if rank % shard_size == col:
            mine["replicate"] = g
    return mine["shard"], mine["replicate"]


def resolve_groups(strategy: ShardingStrategy, process_group, device_mesh) -> ShardGroups:
    """Turn torch's ways of naming groups into :class:`ShardGroups`, with clear errors."""
    if process_group is not None and device_mesh is not None:
        raise ValueError("pass either process_group= or device_mesh=, not both")
    if strategy not in HYBRID:
        if isinstance(process_group, tuple):
            raise ValueError(f"a (shard_group, replicate_group) tuple is for HYBRID_SHARD, not {strategy.name}")
        if device_mesh is not None:
            if device_mesh.ndim != 1:
                raise ValueError(f"{strategy.name} takes a 1-D device_mesh, got {device_mesh.ndim}-D; "
                                 "a 2-D mesh (replicate, shard) is for HYBRID_SHARD")
            return ShardGroups(device_mesh.get_group(0))
        return ShardGroups(process_group if process_group is not None else dist.group.WORLD)
    if device_mesh is not None:
        if device_mesh.ndim != 2:
            raise ValueError(f"{strategy.name} needs a 2-D device_mesh (replicate dim first, shard second), "
                             f"got {device_mesh.ndim}-D; e.g. init_device_mesh('cpu', (2, 2))")
        groups = ShardGroups(device_mesh.get_group(1), device_mesh.get_group(0))
    elif isinstance(process_group, tuple) and len(process_group) == 2:
        groups = ShardGroups(process_group[0], process_group[1])
    else:
        raise ValueError(
            f"{strategy.name} needs its two groups: device_mesh=init_device_mesh(device, (replicate, shard)) "
            "or process_group=(shard_group, replicate_group) (see minifsdp.fsdp.sharding.hybrid_groups)."
        )
    world = dist.get_world_size()
    if groups.data_parallel_size != world:
        raise ValueError(
            f"{strategy.name}: shard group of {groups.shard_size} x replicate group of "
            f"{dist.get_world_size(groups.replicate)} ranks = {groups.data_parallel_size}, but the world size is "
            f"{world}; the groups must tile the world (e.g. 4 ranks = 2 x 2)."
        )
    return groups


class _DoneWork:
    """What an already finished collective returns, so callers can always ``.wait()``."""

    def wait(self):
        return True


class Comm:
    """The three collectives FSDP needs, from torch (``kind="torch"``) or our ring (``kind="ring"``).

    Both follow torch's tensor semantics: ``all_gather(out, inp)`` writes N
    shards side by side into ``out`` (``all_gather_into_tensor``);
    ``reduce_scatter(out, inp)`` sums ``inp`` over ranks and keeps rank r's
    1/N in ``out`` (``reduce_scatter_tensor``).  Each returns a work object
    with ``.wait()``.
    """

    def __init__(self, kind: str = "torch"):
        if kind not in ("torch", "ring"):
            raise ValueError(f"collectives must be 'torch' or 'ring', got {kind!r}")
        self.kind = kind
        self._impl = get_collectives(kind)  # collectives.py: ours (ring) or torch.distributed's, one interface

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, group, async_op: bool = False):
        return _work(self._impl.all_gather(out, inp, group=group, async_op=async_op))

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, group, async_op: bool = False):
        return _work(self._impl.reduce_scatter(out, inp, group=group, async_op=async_op))

    def all_reduce(self, t: torch.Tensor, group, async_op: bool = False):
        return _work(self._impl.all_reduce(t, group=group, async_op=async_op))


def _work(work):
    return work if work is not None else _DoneWork()
