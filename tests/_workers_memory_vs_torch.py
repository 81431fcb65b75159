"""Rank function for tests/test_memory_vs_torch.py: live tensor bytes per rank, ours against torch FSDP1.

The instrument is the census (``minifsdp.memory.census.live_tensor_bytes``: every storage Python can
reach, each counted once), which sees a copy the model no longer points to, such as the full-size
original parameters our layout used to keep after flattening (issue 19).
"""

from __future__ import annotations

import functools
import gc

import torch
import torch.distributed as dist
import torch.nn as nn

from minifsdp.fsdp import FSDP, ShardingStrategy
from minifsdp.fsdp.sharding import hybrid_groups
from minifsdp.fsdp.wrap import transformer_auto_wrap_policy
from minifsdp.memory.census import live_tensor_bytes
from minifsdp.models import Block, CharCorpus, GPTConfig, TinyGPT


def _odd_mlp() -> nn.Module:
    torch.manual_seed(0)  # flat sizes 78, 154, 36: no world size in {2, 3, 4} divides them all
    return nn.Sequential(nn.Linear(5, 13), nn.ReLU(), nn.Linear(13, 11), nn.ReLU(), nn.Linear(11, 3))


def _build(kind: str, config: str):
    if kind == "gpt":
        model = TinyGPT(getattr(GPTConfig, config)(), seed=0)
        return model, {Block}
    return _odd_mlp(), {nn.Linear}


def _wrap(side: str, model, layer_cls, strategy: str, orig: bool):
    groups = {}
    if strategy == "HYBRID_SHARD":
        groups = {"process_group": hybrid_groups(2)}
    if side == "ours":
        policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls=layer_cls)
        return FSDP(model, sharding_strategy=ShardingStrategy[strategy], auto_wrap_policy=policy,
                    use_orig_params=orig, **groups)
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
    from torch.distributed.fsdp import ShardingStrategy as TS
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy as torch_policy

    policy = functools.partial(torch_policy, transformer_layer_cls=layer_cls)
    return TorchFSDP(model, sharding_strategy=TS[strategy], auto_wrap_policy=policy, use_orig_params=orig,
                     device_id=torch.device("cpu"), **groups)


def _step(kind, model, opt, corpus, rank, world):
    if kind == "gpt":
        x, y = corpus.batch(0, 2, 32, rank, world)
        loss = model(x, y)
    else:
        g = torch.Generator().manual_seed(rank)
        loss = torch.nn.functional.mse_loss(model(torch.randn(4, 5, generator=g)), torch.randn(4, 3, generator=g))
    loss.backward()
    opt.step()
    opt.zero_grad()


def live_bytes_worker(kind: str, config: str, strategies: tuple, origs: tuple) -> dict:
    """{(side, strategy, orig): {"after_wrap": bytes, "at_rest": bytes}} above what was alive before building."""
    rank, world = dist.get_rank(), dist.get_world_size()
    corpus = CharCorpus() if kind == "gpt" else None
    out = {}
    for strategy in strategies:
        for orig in origs:
            for side in ("ours", "torch"):
                gc.collect()
                dist.barrier()
                base = live_tensor_bytes()
                model, layer_cls = _build(kind, config)
                model = _wrap(side, model, layer_cls, strategy, orig)
                after_wrap = live_tensor_bytes() - base
                opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
                _step(kind, model, opt, corpus, rank, world)
                at_rest = live_tensor_bytes() - base
                out[(side, strategy, orig)] = {"after_wrap": after_wrap, "at_rest": at_rest}
                del model, opt
    return out


def hidden_copy_worker() -> dict:
    """The census must see a full copy the model does not point to: the instrument's own failure test."""
    gc.collect()
    base = live_tensor_bytes()
    model = _wrap("ours", *_build("gpt", "tiny"), "FULL_SHARD", False)
    without = live_tensor_bytes() - base
    hidden = [p.detach().clone() for p in TinyGPT(GPTConfig.tiny(), seed=0).parameters()]
    keep = (lambda: hidden)  # reachable only through this closure
    with_copy = live_tensor_bytes() - base
    nbytes = sum(t.numel() * t.element_size() for t in keep())
    del model
    return {"without": without, "with": with_copy, "copy": nbytes}


def dropped_model_worker(cases: tuple) -> dict:
    """{case: bytes still alive after the user drops the model and optimizer}: must be 0.

    A hook registered on a tensor lives in C++, out of the garbage collector's sight; a hook that
    holds its module makes a cycle nothing can collect, and every model built and dropped (a notebook,
    a sweep, a test suite) stays in memory.  Each case trains one step, exercising every hook ours
    registers, then drops everything and counts what is left.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    corpus = CharCorpus()
    out = {}
    for case in cases:
        strategy, _, variant = case.partition("+")
        gc.collect()
        base = live_tensor_bytes()
        model = TinyGPT(GPTConfig.tiny(), seed=0)
        if variant == "frozen":
            model.blocks[0].requires_grad_(False)  # a frozen unit: the reshard-only hook
        if strategy == "DDP":
            from minifsdp.ddp import DistributedDataParallel

            model = DistributedDataParallel(model)
        else:
            model = _wrap("ours", model, {Block}, strategy, variant == "orig")
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
        if variant == "no_sync":
            with model.no_sync():
                model(*corpus.batch(1, 2, 32, rank, world)).backward()
        _step("gpt", model, opt, corpus, rank, world)
        if variant == "summon":
            with FSDP.summon_full_params(model):
                pass
            model.state_dict()
        del model, opt
        gc.collect()
        out[case] = live_tensor_bytes() - base
    return out
