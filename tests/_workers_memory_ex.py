"""Rank function for tests/exercises/test_memory_exercises.py (tasks 2.3 and 2.4): one run, every measurement.

One spawn of 3 ranks measures world size 3 (all ranks) and world size 2 (a group of ranks 0 and 1;
rank 2 waits).  For our DDP and our FSDP (FULL_SHARD, SHARD_GRAD_OP, NO_SHARD) on TinyGPT, blocks
wrapped, all with our ring collectives (``collectives="ring"``) so that ``count_bytes()`` sees every
data byte they send:

1. build, AdamW, one warm-up step (lazy init; Adam's state appears);
2. one counted step: forward, backward, ``optimizer.step()`` inside ``count_bytes()``;
3. at rest after it, the model state from the tensors (``snapshot``: each storage once).

Returns plain numbers per (world size, setup); the grader compares them with the students' formulas.
The vocabulary size is the grader's to choose (drawn from the grading seed): it moves the root unit's size, so
the numbers to predict are not the same in every grading.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from minifsdp.comm.ring import count_bytes
from minifsdp.ddp import DistributedDataParallel as DDP
from minifsdp.fsdp import FSDP
from minifsdp.fsdp.core.wrap import transformer_auto_wrap_policy
from minifsdp.memory.tracker import snapshot
from minifsdp.models import Block, CharCorpus, GPTConfig, TinyGPT

BATCH = 4
SETUPS = ("DDP", "FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD")


def _build(kind: str, group, cfg: GPTConfig):
    model = TinyGPT(cfg, seed=0)
    if kind == "DDP":
        return DDP(model, process_group=group, collectives="ring")
    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})
    return FSDP(model, process_group=group, sharding_strategy=kind, auto_wrap_policy=policy, collectives="ring")


def _unit_numels(model) -> list[int]:
    """Unpadded numel of each unit's flat parameter, root first (pre-order), as the tasks take them."""
    return [u._handle.layout.numel for u in model.modules() if isinstance(u, FSDP) and u._handle is not None]


def _measure(kind: str, group, cfg: GPTConfig) -> dict:
    corpus = CharCorpus(vocab_size=cfg.vocab_size)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    model = _build(kind, group, cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(2):  # the second step is the one counted: lazy init and Adam's first step are behind it
        x, y = corpus.batch(step, BATCH, cfg.block_size, rank, world)
        with count_bytes() as sent:
            loss = model(x, y)
            loss.backward()
            opt.step()
        del loss
    state = snapshot(model, opt)
    return {
        "units": _unit_numels(model) if kind != "DDP" else [],
        "sent": sent.sent,
        "messages": sent.messages,
        "model_state": state["parameters"] + state["gradients"] + state["optimizer_state"],
        "n_optimized": sum(len(g["params"]) for g in opt.param_groups),
    }


def measure_memory_and_bytes(vocab_size: int = 96) -> dict:
    """{world_size: {setup: numbers}} for this rank; world size 2 only on ranks 0 and 1."""
    cfg = GPTConfig(vocab_size=vocab_size)
    pair = dist.new_group([0, 1])  # every rank must take part in making a group
    out = {"num_params": sum(p.numel() for p in TinyGPT(cfg, seed=0).parameters())}
    out[3] = {kind: _measure(kind, None, cfg) for kind in SETUPS}
    if dist.get_rank() < 2:
        out[2] = {kind: _measure(kind, pair, cfg) for kind in SETUPS}
    dist.barrier()
    return out
