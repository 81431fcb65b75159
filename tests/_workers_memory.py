"""Rank functions for tests/test_memory.py (module level, so spawn can pickle them)."""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.distributed as dist
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

from minifsdp.comm.collectives import torch_lets_go
from minifsdp.memory import MemoryTracker, snapshot
from minifsdp.memory.census import live_tensor_bytes
from minifsdp.models import Block, CharCorpus, GPTConfig, TinyGPT

BATCH = 8


def _wrap(kind: str, model: torch.nn.Module):
    """Wrap the tiny GPT as torch DDP or torch FSDP1 (transformer blocks as units)."""
    if kind == "DDP":
        from torch.nn.parallel import DistributedDataParallel

        # gradient_as_bucket_view: .grad IS the reducer's bucket, so the tracker sees DDP's whole gradient memory
        return DistributedDataParallel(model, gradient_as_bucket_view=True)
    if kind.startswith("FSDP2"):  # torch's fully_shard: DTensor parameters, one unit per block + the root
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        if kind == "FSDP2_DEFAULT":  # fully_shard's defaults: blocks reshard after forward, the root does not
            for block in model.blocks:
                fully_shard(block, mesh=mesh)
            return fully_shard(model, mesh=mesh)
        reshard = kind == "FSDP2_FULL_SHARD"
        for block in model.blocks:
            fully_shard(block, mesh=mesh, reshard_after_forward=reshard)
        return fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
    if kind.startswith("OURS_"):
        from minifsdp.fsdp import FullyShardedDataParallel as Ours

        policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})
        return Ours(model, sharding_strategy=kind[len("OURS_"):], auto_wrap_policy=policy)
    from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy

    return FullyShardedDataParallel(
        model,
        sharding_strategy=getattr(ShardingStrategy, kind),
        auto_wrap_policy=functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block}),
        device_id=torch.device("cpu"),  # FSDP1 on CPU must be told so, or it looks for an accelerator
    )


def _unit_numels(wrapped) -> list[tuple[int, int]]:
    """(unpadded, padded) unsharded numel of each FSDP1 unit's flat parameter, root first (pre-order)."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    from minifsdp.fsdp import FullyShardedDataParallel as Ours

    if isinstance(wrapped, Ours):  # ours: the same numbers, from each unit's layout
        return [(u._handle.layout.numel, u._handle.layout.padded_numel)
                for u in wrapped.modules() if isinstance(u, Ours) and u._handle is not None]
    out = []
    for unit in FullyShardedDataParallel.fsdp_modules(wrapped):
        fp = unit._handle.flat_param
        out.append((fp._unpadded_unsharded_size.numel(), fp._padded_unsharded_size.numel()))
    return out


def measure_setups(kinds, track_storage_resize=True):
    """For each wrapper kind: one warm-up step, then one tracked AdamW step; return the numbers.

    Each setup lives inside ``_measure_one`` and dies with it, so the next one is measured with only
    itself alive (the tracker counts every live tensor: a previous model kept alive, e.g. by a loss
    whose graph still points at its parameters, would be counted as "resident").  "baseline" is the
    census just before a setup is built: what earlier setups left behind (torch FSDP1 and ours keep a
    dropped model's shards alive through a reference cycle the garbage collector cannot see into).
    """
    out = {}
    for name in kinds:  # torch's side: its collectives' wait() returns once gloo has let go of the tensors, as ours
        torch_side = not name.startswith(("OURS_", "DDP"))
        with torch_lets_go() if torch_side else contextlib.nullcontext():
            out[name] = _measure_one(name, track_storage_resize)
    return out


def _measure_one(name, track_storage_resize):
    baseline = live_tensor_bytes()
    corpus, rank, world = CharCorpus(), dist.get_rank(), dist.get_world_size()
    # "KIND@odd": a GPT whose blocks have an odd number of elements, so FSDP must pad them
    kind, _, variant = name.partition("@")
    cfg = GPTConfig(n_embd=33, n_head=3) if variant == "odd" else GPTConfig.tiny()
    base = TinyGPT(cfg, seed=0)
    n_params = sum(p.numel() for p in base.parameters())  # parameters() dedups the tied weight
    n_tensors = len(list(base.parameters()))
    model = _wrap(kind, base)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = corpus.batch(0, BATCH, base.cfg.block_size, rank, world)
    model(x, y).backward()  # warm-up: Adam's state exists from now on
    opt.step()
    opt.zero_grad(set_to_none=False)  # keep .grad between steps in every setup (DDP's bucket views need it)
    x, y = corpus.batch(1, BATCH, base.cfg.block_size, rank, world)
    at_rest_before = snapshot(model, opt)
    with MemoryTracker(model, opt, track_storage_resize=track_storage_resize) as mt:
        mt.mark("forward")
        loss = model(x, y)
        mt.mark("backward")
        loss.backward()
        mt.mark("step")
        opt.step()
    return {
        "n_params": n_params,
        "n_tensors": n_tensors,
        "units": _unit_numels(model) if kind.removeprefix("OURS_") in ("FULL_SHARD", "SHARD_GRAD_OP") else [],
        "rest": at_rest_before,
        "peak": mt.peak_bytes,
        "peak_phase": mt.peak_phase,
        "at_peak": mt.breakdown_at_peak,
        "end_of_forward": mt.breakdown_at("backward"),
        "end": mt.breakdown_at("end"),
        "timeline_points": len(mt.timeline),
        "resizes": mt.storage_resizes,
        "found_at_exit": mt.found_at_exit,
        "baseline": baseline,
    }
