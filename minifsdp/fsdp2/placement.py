"""Chapter 5: ``shard_placement_fn``, sharding a parameter along another dim than rows (``Shard(d)``), as torch's.

``fully_shard(module, shard_placement_fn=fn)`` calls ``fn(param)`` for each parameter it takes: ``None`` keeps the
core's rows (``Shard(0)``), ``Shard(d)`` cuts along dim ``d`` instead (e.g. a weight's largest dim).  As torch's,
d's size must divide evenly by the shard group's size, so nothing is padded::

    weight (2 x 6), Shard(1), N = 2       rank 0: columns 0-2, made contiguous   rank 1: columns 3-5
    [a b c | d e f]                       [a b c]                                [d e f]
    [g h i | j k l]                       [g h i]                                [j k l]

The all-gather still moves each rank's chunk as flat numbers (the core's copy-in); what differs is the way back
and the gradient's way out, so :class:`ShardPlacement` plugs in at three points of the core
(:mod:`minifsdp.fsdp2.core.plugin`):

* ``after_shard``: re-cut each such parameter along d (the core cut rows first; the original is still whole);
* ``all_gather``: the core's gather, with a copy-out that concatenates the N chunks along d
  (:func:`copy_out_param`, torch's ``torch.cat(chunks, dim=shard_dim)``);
* ``before_reduce``: each such gradient cut into N chunks along d and stacked as rows (torch's
  ``torch.cat(torch.chunk(grad, N, dim=d), dim=0)``), so the core's row-wise reduce-scatter gives rank r chunk r.

A placement torch refuses is refused at the call, before anything is sharded: a dim outside the parameter's dims
(``AssertionError``, as torch's, naming the parameter, the dim and its number of dims), not a ``Shard``
(``NotImplementedError``), a dim that does not divide evenly (``NotImplementedError``, torch's message).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn
from torch.distributed.tensor import Shard

from minifsdp.fsdp2.core import FSDPParam, Plugin, foreach_all_gather

__all__ = ["resolve_placements", "ShardPlacement", "copy_out_param"]


def resolve_placements(modules: tuple[nn.Module, ...], params: list[nn.Parameter], world_size: int,
                       shard_placement_fn: Callable | None) -> dict[int, int]:
    """``{id(param): d}`` for each parameter ``shard_placement_fn`` puts on a dim d other than 0, every answer
    checked as torch checks it."""
    if shard_placement_fn is None:
        return {}
    names = {id(p): n for m in modules for n, p in m.named_parameters()}
    dims = {}
    for p in params:
        placement = shard_placement_fn(p)
        if placement is None:
            continue
        if not isinstance(placement, Shard):
            raise NotImplementedError(f"fully_shard: shard_placement_fn returned {placement} for parameter "
                                      f"'{names.get(id(p), '?')}'; return a Shard(dim) or None")
        dim = placement.dim + p.ndim if placement.dim < 0 else placement.dim
        if not 0 <= dim < p.ndim:
            raise AssertionError(f"Shard dim {placement.dim} is invalid for {p.ndim}D tensor: {p.shape}. fully_shard's "
                                 f"shard_placement_fn returned Shard({placement.dim}) for parameter "
                                 f"'{names.get(id(p), '?')}', which has {p.ndim} dim(s): return Shard(d) with "
                                 f"0 <= d < {p.ndim}, or None for Shard(0)")
        if dim != 0 and p.shape[dim] % world_size != 0:
            raise NotImplementedError(f"FSDP does not support uneven sharding on dim {dim}: {p.shape} (world size: "
                                      f"{world_size})")
        if dim != 0:
            dims[id(p)] = dim
    return dims


def shard_dim(p: FSDPParam) -> int:
    return p.placements[-1].dim if p.placements else 0


def copy_out_param(p: FSDPParam, columns: torch.Tensor) -> None:
    """``columns``: ``(N, shard numel)``, rank r's chunk of ``p`` in row r; into ``p``'s full buffer (rows
    stacked for ``Shard(0)``, the chunks concatenated along d for ``Shard(d)``)."""
    d = shard_dim(p)
    if d != 0 and p.full_padded is None:  # the buffer holds the weight in its own layout, all of it the weight
        p.full_padded = torch.empty(p.world_size * p.shard_numel, dtype=p.unsharded_dtype, device=p.device)
        p.unsharded_param = nn.Parameter(p.full_padded.view(p.full_size), p.sharded_param.requires_grad)
    full = p.alloc_unsharded()
    with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(full):
        if d == 0:
            full.view(columns.shape).copy_(columns)
        else:
            chunks = columns.reshape(columns.shape[0], *p.padded_size).unbind(0)
            torch.cat(chunks, dim=d, out=full.view(p.full_size))


class _PlacedGather:
    """The core's all-gather result, copied out per parameter (:func:`copy_out_param`)."""

    def __init__(self, result):
        self.result = result

    def copy_out(self) -> None:
        start = 0
        for p, n in zip(self.result.params, self.result.numels, strict=True):
            copy_out_param(p, self.result.rows[:, start: start + n])
            start += n


class ShardPlacement(Plugin):
    """The plugin for ``shard_placement_fn``: ``dims`` is :func:`resolve_placements`' answer."""

    def __init__(self, dims: dict[int, int]):
        self.dims = dims

    def after_shard(self, group, originals: list[nn.Parameter]) -> None:
        for p, orig in zip(group.fsdp_params, originals, strict=True):
            d = self.dims.get(id(orig))
            if d is None:
                continue
            chunk = orig.detach().chunk(p.world_size, dim=d)[p.rank]
            p.padded_local = orig.new_zeros(chunk.shape)  # a contiguous copy of this rank's chunk
            p.padded_local.copy_(chunk)
            p.padded_size = p.local_size = chunk.shape
            p.placements = (*p.placements[:-1], Shard(d))
            p.sharded_param = nn.Parameter(p.to_sharded_dtensor(p.local_view(p.padded_local)), orig.requires_grad)
            p.install(p.sharded_param)

    def all_gather(self, group):
        if all(shard_dim(p) == 0 for p in group.fsdp_params):
            return None
        inputs = [p.all_gather_input() for p in group.fsdp_params]
        return _PlacedGather(foreach_all_gather(group.fsdp_params, inputs, group.fsdp_params[0].unsharded_dtype,
                                                group.comm, group.group, group.rank, group.world_size))

    def before_reduce(self, group, params: list, grads: list[torch.Tensor]) -> None:
        for i, p in enumerate(params):
            if shard_dim(p) != 0 and group.world_size > 1:
                grads[i] = torch.cat(torch.chunk(grads[i], group.world_size, dim=shard_dim(p)), dim=0)
