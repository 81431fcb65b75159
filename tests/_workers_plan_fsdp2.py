"""Rank function for tests/test_plan_fsdp2_measured.py: the book's models under ``fully_shard`` (ours and torch's),
one step at rest, for ``python -m minifsdp plan --impl fsdp2`` to be held against.

For each setup (a model, whose ``fully_shard``), on all the ranks: a census before anything is built; build
(seed 0), ``fully_shard`` each block (each Linear of the MLP), then the root; AdamW (``foreach=True``), one
warm-up step, ``zero_grad()``; one step (ours on our ring, inside ``count_bytes()``); then at rest: the model state
from the tensors (``snapshot``, each storage once) and every live byte less the first census; then in a
``MemoryTracker``, ``zero_grad()`` and one step: the peak less the first census.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn

from minifsdp.comm.collectives import torch_lets_go
from minifsdp.fsdp2 import fully_shard
from minifsdp.memory.census import live_tensor_bytes
from minifsdp.models import MLP, Block, GPTConfig, TinyGPT
from tests._workers_plan import MLP_DIMS, measured_step

SETUPS = [("tiny", "ours"), ("mlp-odd", "ours"), ("tiny", "torch"), ("mlp-odd", "torch")]


def _build(model_name: str, impl: str) -> nn.Module:
    if impl == "torch":
        from torch.distributed.fsdp import fully_shard as shard
    else:
        def shard(module):
            return fully_shard(module, collectives="ring")
    if model_name == "tiny":
        model, layer = TinyGPT(GPTConfig.tiny(), seed=0), Block
    else:
        model, layer = MLP(MLP_DIMS[model_name], seed=0), nn.Linear
    for m in [m for m in model.modules() if isinstance(m, layer)]:
        shard(m)
    return shard(model)


def _measure(model_name: str, impl: str) -> dict:
    before = live_tensor_bytes()
    model = _build(model_name, impl)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    return measured_step(model_name, model, opt, before)


def measure_fsdp2_setups() -> dict:
    """{(model, impl): this rank's numbers} for every setup."""
    torch.manual_seed(0)
    _measure("mlp-odd", "ours")  # our ring keeps a 64-byte header buffer from its first use on: not the setups'
    torch.distributed.barrier()
    out = {}
    for model_name, impl in SETUPS:
        with torch_lets_go() if impl == "torch" else contextlib.nullcontext():
            out[(model_name, impl)] = _measure(model_name, impl)
        torch.distributed.barrier()
    return out

