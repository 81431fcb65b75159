"""Rank function for tests/test_plan_measured.py: the book's models trained one step under every strategy,
measured three ways on every rank, for ``python -m minifsdp plan`` to be held against.

For each setup (a model, a strategy, an optimizer, a precision), on a process group of all the ranks:

1. a census (``live_tensor_bytes``) before anything is built: what this setup must not be charged for;
2. build (seed 0), wrap (ours: ``minifsdp.FSDP`` or ``minifsdp.DDP`` on our ring collectives, so that
   ``count_bytes()`` sees every data byte), AdamW or SGD with momentum (``foreach=True``: what torch picks
   on a GPU), one warm-up step (lazy init, the optimizer's state), ``zero_grad()`` (torch's default: to None);
3. one step inside ``count_bytes()``; after it, at rest: the model state from the tensors (``snapshot``) and
   every live byte less the first census (what this setup holds: its shards, buffers, DDP's buckets), read
   at the start of a ``MemoryTracker``, which begins with a census of its own;
4. in that tracker, ``zero_grad()`` and one step, its batch made inside: the peak less the first census,
   and where it happened.

Every setup is built and measured inside :func:`_measure`, and is dead when the next one starts.
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from minifsdp.comm.collectives import torch_lets_go
from minifsdp.comm.counting import count_bytes
from minifsdp.ddp import DistributedDataParallel as DDP
from minifsdp.fsdp import FSDP, MixedPrecision
from minifsdp.fsdp.core.wrap import transformer_auto_wrap_policy
from minifsdp.fsdp.torch_options import hybrid_groups
from minifsdp.memory import MemoryTracker, snapshot
from minifsdp.memory.census import live_tensor_bytes
from minifsdp.models import MLP, Block, CharCorpus, GPTConfig, TinyGPT

BATCH = 8  # sequences (or rows) per rank
MLP_DIMS = {"mlp": (16, 32, 32, 8), "mlp-odd": (12, 33, 7)}  # mlp-odd: units of 429 and 238 numbers: padding


def setups(world_size: int) -> list[tuple[str, str, str, str]]:
    """(model, strategy, optimizer, precision) measured at ``world_size``: the book's two models under every
    strategy (HYBRID_SHARD at 4 ranks, as 2 nodes of 2); at 2 ranks also an MLP whose units no world size
    divides (padding), SGD, bf16 mixed precision, and torch FSDP1 itself (its peak: it frees a unit's gathered
    parameters after autograd concatenates the unit's gradient, ours before)."""
    strategies = ("DDP", "FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD") + (("HYBRID_SHARD",) if world_size == 4 else ())
    out = [(model, s, "adamw", "fp32") for model in ("tiny", "mlp") for s in strategies]
    if world_size == 2:  # (SHARD_GRAD_OP pads and sends as FULL_SHARD does, less the second all-gather)
        out += [("mlp-odd", s, "adamw", "fp32") for s in ("DDP", "FULL_SHARD", "NO_SHARD")]
        out += [("tiny", "FULL_SHARD", "sgd", "fp32"), ("tiny", "FULL_SHARD", "adamw", "bf16"),
                ("tiny", "torch FULL_SHARD", "adamw", "fp32"), ("mlp", "torch FULL_SHARD", "adamw", "fp32")]
    return out


def _build(model_name: str, strategy: str, precision: str, groups) -> nn.Module:
    if model_name == "tiny":
        model, layer = TinyGPT(GPTConfig.tiny(), seed=0), Block
    else:
        model, layer = MLP(MLP_DIMS[model_name], seed=0), nn.Linear
    if strategy == "DDP":
        return DDP(model, collectives="textbook")
    if strategy.startswith("torch "):
        from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy
        from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy as torch_policy

        return FullyShardedDataParallel(model, sharding_strategy=ShardingStrategy[strategy[len("torch "):]],
                                        auto_wrap_policy=functools.partial(torch_policy, transformer_layer_cls={layer}),
                                        device_id=torch.device("cpu"))
    mp = None if precision == "fp32" else MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={layer})
    return FSDP(model, sharding_strategy=strategy, auto_wrap_policy=policy, mixed_precision=mp, collectives="textbook",
                process_group=groups if strategy == "HYBRID_SHARD" else None)


def _loss(model_name: str, model: nn.Module, step: int) -> torch.Tensor:
    rank, world = dist.get_rank(), dist.get_world_size()
    if model_name == "tiny":
        return model(*CharCorpus().batch(step, BATCH, GPTConfig.tiny().block_size, rank, world))
    x, y = MLP(MLP_DIMS[model_name]).batch(step, BATCH, rank, world)
    return F.mse_loss(model(x), y)


def _measure(model_name: str, strategy: str, optimizer: str, precision: str, groups) -> dict:
    before = live_tensor_bytes()
    model = _build(model_name, strategy, precision, groups)
    if optimizer == "adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9, foreach=True)
    return measured_step(model_name, model, opt, before)


def measured_step(model_name: str, model: nn.Module, opt, before: int) -> dict:
    """A warm-up step, a step whose bytes sent are counted, then a step under the memory tracker: this rank's
    numbers (``before``: the live bytes before the model was built)."""
    _loss(model_name, model, 0).backward()  # warm-up: lazy init, the optimizer's state
    opt.step()
    opt.zero_grad()
    with count_bytes() as sent:
        _loss(model_name, model, 1).backward()
        opt.step()
    state = snapshot(model, opt)
    with MemoryTracker(model, opt) as mt:  # it starts from a census (tests/test_memory_census.py)
        mt.mark("at rest")
        opt.zero_grad()
        mt.mark("forward")
        loss = _loss(model_name, model, 2)
        mt.mark("backward")
        loss.backward()
        mt.mark("optimizer step")
        opt.step()
    del loss
    return {
        "sent": sent.sent, "messages": sent.messages,
        "parameters": state["parameters"], "gradients": state["gradients"],
        "optimizer_state": state["optimizer_state"], "buffers": state["buffers"],
        "census": mt.breakdown_at("at rest")["total"] - before, "peak": mt.peak_bytes - before,
        "peak_phase": mt.peak_phase,
        "at_peak": mt.breakdown_at_peak,
    }


def measure_plan_setups() -> dict:
    """{(model, strategy, optimizer, precision): this rank's numbers} for every setup at this world size."""
    torch.manual_seed(0)
    groups = hybrid_groups(2) if dist.get_world_size() == 4 else None
    out = {}
    for setup in setups(dist.get_world_size()):
        # torch's side: its collectives' wait() returns once gloo has let go (else its census reads high by chance)
        with torch_lets_go() if setup[1].startswith("torch ") else contextlib.nullcontext():
            out[setup] = _measure(*setup, groups)
        dist.barrier()
    return out
