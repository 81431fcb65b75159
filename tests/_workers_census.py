"""Rank functions for tests/test_memory_census.py (module level, so spawn can pickle them)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from minifsdp.memory import MemoryTracker
from minifsdp.memory.census import live_tensor_bytes
from minifsdp.models import CharCorpus, GPTConfig, TinyGPT
from tests._workers_memory import BATCH, _wrap


def census_vs_tracker(kinds: list[str]) -> dict:
    """For each kind ("DDP", "FULL_SHARD", "FSDP2_FULL_SHARD", "OURS_FULL_SHARD", with "@hidden": a full copy
    of the weights kept in a closure): the tracker's totals beside the census, at rest and at the peak."""
    return {name: _one(name) for name in kinds}


def _one(name: str) -> dict:
    kind, _, variant = name.partition("@")
    baseline = live_tensor_bytes()  # what earlier setups in this process left behind
    corpus, rank, world = CharCorpus(), dist.get_rank(), dist.get_world_size()
    base = TinyGPT(GPTConfig.tiny(), seed=0)
    n_params = sum(p.numel() for p in base.parameters())
    if variant == "hidden":
        # The bug this instrument exists to catch: something keeps the original (full-size) parameters
        # alive after wrapping, where neither the model nor the optimizer can see them.
        originals = list(base.parameters())
        peek = lambda: originals  # noqa: E731  (the closure is the only thing holding them)
    model = _wrap(kind, base)
    del base
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(*corpus.batch(0, BATCH, 32, rank, world)).backward()  # one step: Adam's state exists
    opt.step()
    opt.zero_grad(set_to_none=False)
    x, y = corpus.batch(1, BATCH, 32, rank, world)
    census_before = live_tensor_bytes()
    with MemoryTracker(model, opt, on_peak=lambda: live_tensor_bytes(collect=False)) as mt:
        mt.mark("start")
        model(x, y).backward()
        opt.step()
    census_after = live_tensor_bytes()
    out = {
        "n_params": n_params,
        "baseline": baseline,
        "census_before": census_before,
        "census_after": census_after,
        "start": mt.breakdown_at("start"),
        "end": mt.breakdown_at("end"),
        "current_bytes": mt.current_bytes,
        "found_at_exit": mt.found_at_exit,
        "peak": mt.peak_bytes,
        "census_at_peak": mt.on_peak_result,
    }
    if variant == "hidden":
        out["hidden_bytes"] = sum(4 * p.numel() for p in peek())
    return out
