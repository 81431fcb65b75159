"""Rank functions for the core-class tests: ``minifsdp.fsdp.core.FullyShardedDataParallel`` alone against torch FSDP1.

The core class is the one a learner reads (``minifsdp/fsdp/core/``); it must stay proven by itself,
without the public class's extras (``minifsdp/fsdp/fully_sharded.py``).  Clipping and the full state dict are
not the step: ``minifsdp/fsdp/full_params.py``'s functions, called on the core's units.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from minifsdp.fsdp.core import FullyShardedDataParallel as CoreFSDP
from minifsdp.fsdp.core import ShardingStrategy
from minifsdp.fsdp.core.handle import FlatParamHandle
from minifsdp.fsdp.core.units import units_with_params
from minifsdp.fsdp.full_params import clip_grad_norm_, full_state_dict
from tests._workers_fsdp import make_model, policy, to_numpy, train


def core_vs_torch_worker(kinds: list) -> dict:
    """For each model kind: the core class and torch FSDP1 (FULL_SHARD, nested units), trained side by side."""
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
    from torch.distributed.fsdp import ShardingStrategy as TorchStrategy

    rank, world = dist.get_rank(), dist.get_world_size()
    results = {}
    for kind in kinds:
        ours = CoreFSDP(make_model(kind), sharding_strategy=ShardingStrategy.FULL_SHARD,
                        auto_wrap_policy=policy(kind, True))
        handles = [u._handle for u in units_with_params(ours)]
        built = {"classes": sorted({type(u).__qualname__ + "@" + type(u).__module__ for u in ours.modules()
                                    if isinstance(u, CoreFSDP)}),
                 "handles": sorted({type(h).__module__ + "." + type(h).__qualname__ for h in handles}),
                 "exact_handle": all(type(h) is FlatParamHandle for h in handles),
                 "padding": [h.layout.padded_numel - h.layout.numel for h in handles]}
        theirs = TorchFSDP(make_model(kind), sharding_strategy=TorchStrategy.FULL_SHARD,
                           auto_wrap_policy=policy(kind, False), device_id=torch.device("cpu"), use_orig_params=False)
        out = {"built": built}
        for name, model in (("ours", ours), ("torch", theirs)):
            losses, norms = train(model, kind, "adamw", rank, world, clip=clip_grad_norm_ if name == "ours" else True)
            shards = [p.detach().clone() for p in model.parameters()]  # each unit's local flat shard, pre-order
            if name == "ours":
                full = dict(full_state_dict(model))
            else:
                with TorchFSDP.summon_full_params(model):
                    full = {k.replace("_fsdp_wrapped_module.", ""): v.detach().clone()
                            for k, v in model.named_parameters()}
            out[name] = dict(losses=losses, norms=norms, shards=shards, full=full)
        results[kind] = out
    return to_numpy(results)
