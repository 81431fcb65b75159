"""Rank functions for tests/exercises/projects/test_hybrid.py: a gradient reduction beside torch FSDP1 HYBRID_SHARD.

Two spawns of 4 ranks.  In the first (:func:`torch_on_rank`, no learner code), for each case, torch FSDP1 wraps
the same MLP (widths 16, 33, 31, 8: three units of 256, 561 and 1,054 numbers, two of which no shard group size
divides) with ``HYBRID_SHARD`` over ``(shard_group, replicate_group)`` and runs one backward on each rank's own
data (drawn from the grading seed) twice:

1. inside ``no_sync()``: each unit's ``flat_param.grad`` is then this rank's own, unreduced gradient (the
   input of the reduction; torch computes it, so it is the input torch reduces);
2. outside it: each unit's sharded ``flat_param.grad`` is torch's reduced shard (the oracle);

with the bytes the book's ring sends for a reduce-scatter inside the shard group and an all-reduce of the shard
across replicas.  In the second (:func:`learner_on_rank`), the function under test reduces (1) inside
``count_bytes()``, on groups of the same layout with a short timeout: per unit, what it returned, the bytes it
sent, and whether it modified the input.

Cases (shard groups of consecutive ranks, ``minifsdp.fsdp.torch_options.hybrid_groups``):
* ``2x2-fp32``: shard groups {0, 1}, {2, 3}; replicas {0, 2}, {1, 3};
* ``2x2-fp16``: ``MixedPrecision(param_dtype=fp16, reduce_dtype=fp16)``, the loss times 1e-4 (gradients near
  fp16's smallest normal number, where every division rounds);
* ``4x1-fp16``: one shard group of all 4 ranks, replicate groups of 1 (the layout where torch's factors, 2
  and 2, differ from the group sizes, 4 and 1).
"""

from __future__ import annotations

import functools
import importlib

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
from torch.distributed.fsdp import MixedPrecision, ShardingStrategy
from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy

from minifsdp.classroom.course_remote import capture, to_bytes
from minifsdp.classroom.course_rules import enforce_here
from minifsdp.comm.ring import all_gather_chunks, chunk_bounds, count_bytes, reduce_scatter_chunks
from minifsdp.fsdp.torch_options import hybrid_groups
from minifsdp.models import MLP
from tests.exercises import learner_group

DIMS = (16, 33, 31, 8)
CASES = {"2x2-fp32": (2, torch.float32, 1.0), "2x2-fp16": (2, torch.float16, 1e-4),
         "4x1-fp16": (4, torch.float16, 1e-4)}


def ring_bytes(numel: int, shard_size: int, replicas: int, rank_in_shard: int, rank_in_replicas: int,
               itemsize: int) -> int:
    """What the book's ring sends from this rank: a reduce-scatter of the padded gradient inside the shard group,
    then an all-reduce of the shard across the replicas (each chunk counted as ``minifsdp.comm.ring`` sends it)."""
    padded = -(-numel // shard_size) * shard_size
    sent = 0
    for n, r, size, phases in ((shard_size, rank_in_shard, padded, (reduce_scatter_chunks,)),
                               (replicas, rank_in_replicas, padded // shard_size,
                                (reduce_scatter_chunks, all_gather_chunks))):
        bounds = chunk_bounds(size, n)
        for chunks_of in phases:
            for step in range(n - 1):
                lo, hi = bounds[chunks_of(r, n, step)[0]]
                sent += hi - lo
    return sent * itemsize


def _units(model):
    return [m for m in model.modules() if isinstance(m, TorchFSDP) and m._handle is not None]


def _torch_case(shard_size: int, dtype, scale: float, groups, seed: int) -> list[dict]:
    rank, world = dist.get_rank(), dist.get_world_size()
    shard_group, replicate_group = groups
    mp = None if dtype == torch.float32 else MixedPrecision(param_dtype=dtype, reduce_dtype=dtype)
    model = TorchFSDP(MLP(DIMS, seed=0), process_group=groups, sharding_strategy=ShardingStrategy.HYBRID_SHARD,
                      mixed_precision=mp, device_id=torch.device("cpu"),
                      auto_wrap_policy=functools.partial(size_based_auto_wrap_policy, min_num_params=200))
    x, y = MLP(DIMS).batch(seed, 4, rank, world)
    with model.no_sync():
        (F.mse_loss(model(x), y) * scale).backward()
    full = [u._handle.flat_param.grad.detach().clone() for u in _units(model)]
    model.zero_grad(set_to_none=True)
    (F.mse_loss(model(x), y) * scale).backward()
    shards = [u._handle.flat_param.grad.detach().clone() for u in _units(model)]
    return [{"torch": want, "input": grad.to(dtype),
             "ring_bytes": ring_bytes(grad.numel(), shard_size, world // shard_size, dist.get_rank(shard_group),
                                      dist.get_rank(replicate_group), grad.to(dtype).element_size())}
            for grad, want in zip(full, shards, strict=True)]


def torch_on_rank(seed: int) -> dict:
    """The oracle, on every rank: {case: [per unit {"torch", "input", "ring_bytes"}]}."""
    layouts = {size: hybrid_groups(size) for size in sorted({s for s, _, _ in CASES.values()})}  # on every rank
    return {name: _torch_case(size, dtype, scale, layouts[size], seed) for name, (size, dtype, scale) in CASES.items()}


def _learner_groups(shard_size: int):
    """hybrid_groups' layout (shard groups of consecutive ranks), on groups with the learner's short timeout."""
    world, rank, mine = dist.get_world_size(), dist.get_rank(), {}
    for start in range(0, world, shard_size):
        g = learner_group(range(start, start + shard_size))
        if start <= rank < start + shard_size:
            mine["shard"] = g
    for col in range(shard_size):
        g = learner_group(range(col, world, shard_size))
        if rank % shard_size == col:
            mine["replicate"] = g
    return mine["shard"], mine["replicate"]


def learner_on_rank(name: str, inputs: dict) -> bytes:
    """The learner's ``hybrid_reduce_gradient`` on every rank, on torch's inputs (``inputs[case][rank]``):
    {case: [per unit {"yours", "sent", "modified"}]}, or {"raised": ...} at the first call that raised."""
    enforce_here(("project-hybrid",))
    layouts = {size: _learner_groups(size) for size in sorted({s for s, _, _ in CASES.values()})}  # on every rank
    mod = capture(importlib.import_module, name)
    if "raised" in mod:
        return to_bytes({"raised": mod["raised"]})
    out = {}
    for case, (size, _, _) in CASES.items():
        out[case] = []
        for given in inputs[case][dist.get_rank()]:
            sent_in = given.clone()
            with count_bytes() as sent:
                got = capture(mod["value"].hybrid_reduce_gradient, sent_in, *layouts[size])
            if "raised" in got:
                return to_bytes({"raised": got["raised"]})
            value = got["value"]
            out[case].append({"yours": value.detach().clone() if isinstance(value, torch.Tensor) else repr(value)[:200],
                              "sent": sent.sent, "modified": not torch.equal(sent_in, given)})
    return to_bytes(out)
