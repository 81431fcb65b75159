"""What one training step costs each rank: bytes sent, collectives issued, memory held, time (chapters 2.2-2.4).

Notebook 02 measures the tiny GPT of every chapter (one FSDP unit per ``Block``, the root unit for the
rest) under each way of training it, at 1, 2 and 4 ranks.  Each function here is one experiment, run
on every rank of a process group that already exists (``minifsdp.spawn(fn, args, world_size=n)``, or
the notebook kernel's own 1-rank group), and returns what this rank measured:

    all_reduce_bytes(numel)   ch 2.2: bytes this rank sends in one all-reduce of ``numel`` fp32 (ring or naive)
    step_bytes(kind)          ch 2.4: bytes this rank sends in one training step, on our ring collectives
    step_collectives(kind)    ch 2.4: how many collectives one forward + backward issues
    step_memory(kind)         ch 2.3: the model state after one AdamW step, the peak and its breakdown
    step_times(kinds)         ch 2.4: the median step time of each kind, the kinds taking turns
    prefetch_fsdp(setting)    ch 2.5: FSDP with one of the ``PREFETCH`` settings, ours or torch FSDP1's

    kind            what trains the model
    "DDP"           our DistributedDataParallel (chapter 1)
    "FULL_SHARD"    our FSDP, the class chapter 2 reads (``minifsdp.fsdp.core``), one unit per Block;
                    also "SHARD_GRAD_OP", "NO_SHARD"
    "FULL_SHARD, no prefetch"   the same with ``backward_prefetch=None``
    "torch DDP", "torch FULL_SHARD", "torch SHARD_GRAD_OP", "torch NO_SHARD"   torch's own, the same way

Every kind trains the same model (seed 0) on the same data: rank r's slice of batch s of the corpus,
8 sequences per step over all ranks.  Bytes and memory are exact and repeat run to run; times depend
on the machine's load, so :func:`step_times` returns the load average with them.
"""

from __future__ import annotations

import functools
import itertools
import os
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn

from minifsdp.bench.harness import interleave

OURS = ("DDP", "FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "FULL_SHARD, no prefetch")
TORCH = ("torch DDP", "torch FULL_SHARD", "torch SHARD_GRAD_OP", "torch NO_SHARD")
BATCH = 8  # sequences per step, over all ranks
PREFETCH = {  # chapter 2.5's settings: name -> (backward_prefetch, forward_prefetch)
    "none": (None, False),
    "BACKWARD_PRE": ("BACKWARD_PRE", False),
    "BACKWARD_POST": ("BACKWARD_POST", False),
    "forward+BACKWARD_PRE": ("BACKWARD_PRE", True),
}


def build(kind: str, collectives: str = "torch") -> nn.Module:
    """The tiny GPT (seed 0) trained by ``kind``; ours on ``collectives`` ("torch", or our "ring")."""
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
    from torch.distributed.fsdp import ShardingStrategy as TorchStrategy
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy as torch_policy
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    from minifsdp.ddp import DistributedDataParallel
    from minifsdp.fsdp.core import BackwardPrefetch, ShardingStrategy, transformer_auto_wrap_policy
    from minifsdp.fsdp.core import FullyShardedDataParallel as FSDP
    from minifsdp.models import Block, GPTConfig, TinyGPT

    if kind not in OURS + TORCH:
        raise ValueError(f"unknown kind {kind!r}; one of {OURS + TORCH}")
    model = TinyGPT(GPTConfig.tiny(), seed=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # FSDP on 1 rank: "switching to NO_SHARD"
        if kind == "DDP":
            return DistributedDataParallel(model, collectives=collectives)
        if kind == "torch DDP":  # the buckets are the gradients: the tracker counts them once, as .grad
            return TorchDDP(model, gradient_as_bucket_view=True)
        if kind.startswith("torch "):
            policy = functools.partial(torch_policy, transformer_layer_cls={Block})
            return TorchFSDP(model, sharding_strategy=TorchStrategy[kind[len("torch "):]], auto_wrap_policy=policy,
                             device_id=torch.device("cpu"))
        policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})
        prefetch = None if kind == "FULL_SHARD, no prefetch" else BackwardPrefetch.BACKWARD_PRE
        return FSDP(model, sharding_strategy=ShardingStrategy[kind.split(",")[0]], auto_wrap_policy=policy,
                    backward_prefetch=prefetch, collectives=collectives)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's slice of the ``step``-th batch."""
    from minifsdp.models import CharCorpus, GPTConfig

    return CharCorpus().batch(step, BATCH, GPTConfig.tiny().block_size, dist.get_rank(), dist.get_world_size())


def train_step(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    """Forward, backward, AdamW step; the gradients stay allocated (zeroed), as between steps."""
    model(*batch(step)).backward()
    opt.step()
    opt.zero_grad(set_to_none=False)


def ready(kind: str, collectives: str = "torch") -> tuple[nn.Module, torch.optim.Optimizer]:
    """A model and its AdamW after one step: FSDP's lazy init done, Adam's state allocated."""
    model = build(kind, collectives)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)  # after wrapping: on the shards
    train_step(model, opt, 0)
    return model, opt


def all_reduce_bytes(numel: int = 2**18, how: str = "ring") -> int:
    """Bytes this rank sends in one all-reduce of ``numel`` fp32 numbers (default 1 MiB): ``how`` is "ring" (the
    textbook ring, ``minifsdp/comm/ring.py``) or "naive" (the parameter-server shape; rank 0 is the root)."""
    from minifsdp.comm import count_bytes, naive_all_reduce
    from minifsdp.comm.ring import ring_all_reduce

    with count_bytes() as sent:
        {"ring": ring_all_reduce, "naive": naive_all_reduce}[how](torch.ones(numel))
    return sent.sent


def step_bytes(kind: str) -> int:
    """Bytes this rank sends in one training step (forward, backward, optimizer) on our ring collectives."""
    from minifsdp.comm import count_bytes

    model, opt = ready(kind, "ring")
    with count_bytes() as sent:
        train_step(model, opt, 1)
    return sent.sent


def step_collectives(kind: str) -> int:
    """How many collectives one forward + backward issues (torch's collectives, seen by the tracer)."""
    from minifsdp.pictures.fsdp_plots import CollectiveTracer

    model, opt = ready(kind)
    tracer = CollectiveTracer(None)
    with tracer:
        model(*batch(1)).backward()
    return len(tracer.events)


def step_memory(kind: str, timeline: bool = False) -> dict:
    """One AdamW step under ``MemoryTracker`` (after a warm-up step): what this rank holds.

    Returns ``model_state`` (parameters + gradients + optimizer state at the end, bytes), ``peak`` (bytes)
    with ``at_peak`` (its breakdown by category, the bytes that were alive before and are neither the model's
    nor the optimizer's left out) and ``peak_phase``; with ``timeline``, also the tracker's ``timeline``
    [(seconds, bytes)], its ``marks`` [(name, seconds)] and those ``resident`` bytes.
    """
    from minifsdp.memory import MemoryTracker, without_resident

    model, opt = ready(kind)
    with MemoryTracker(model, opt) as mt:
        mt.mark("forward")
        loss = model(*batch(1))
        mt.mark("backward")
        loss.backward()
        mt.mark("step")
        opt.step()
    del loss  # a loss keeps its graph alive, and with it the parameters the graph saved
    end, at_peak = mt.breakdown_at("end"), without_resident(mt.breakdown_at_peak)
    out = dict(model_state=end["parameters"] + end["gradients"] + end["optimizer_state"], peak=at_peak["total"],
               at_peak=at_peak, peak_phase=mt.peak_phase)
    if timeline:  # every byte alive, the "resident" ones (neither the model's nor the optimizer's) included
        out.update(timeline=list(mt.timeline), marks=list(mt.marks), resident=mt.breakdown_at_peak["resident"])
    return out


def step_times(kinds: tuple[str, ...], steps: int = 5) -> dict:
    """The median time of one training step for each of ``kinds``, the kinds taking turns step by step (so a
    busy second slows them alike; the bench harness), each step started together on every rank and timed on
    the slowest; with the load average."""
    loads = [os.getloadavg()]

    def stepper(model, opt):
        batches = itertools.count(1)
        return lambda: train_step(model, opt, next(batches))

    timings = interleave({kind: stepper(*ready(kind)) for kind in kinds}, steps)
    loads.append(os.getloadavg())
    return {"median_s": {kind: timings.median(kind) for kind in kinds}, "load": loads, "cpus": os.cpu_count()}


def prefetch_fsdp(setting: str, cfg=None, torch_side: bool = False, limit_all_gathers: bool = True) -> nn.Module:
    """A TinyGPT (``cfg``, default tiny; seed 0) wrapped one unit per Block with the ``PREFETCH[setting]``
    arguments: ours (the core class) or, with ``torch_side``, torch FSDP1 with the same arguments."""
    from torch.distributed.fsdp import BackwardPrefetch as TorchPrefetch
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy as torch_policy

    from minifsdp.fsdp.core import BackwardPrefetch, transformer_auto_wrap_policy
    from minifsdp.fsdp.core import FullyShardedDataParallel as FSDP
    from minifsdp.models import Block, GPTConfig, TinyGPT

    backward, forward = PREFETCH[setting]
    model = TinyGPT(cfg or GPTConfig.tiny(), seed=0)
    if torch_side:
        return TorchFSDP(model, auto_wrap_policy=functools.partial(torch_policy, transformer_layer_cls={Block}),
                         backward_prefetch=TorchPrefetch[backward] if backward else None,
                         forward_prefetch=forward, limit_all_gathers=limit_all_gathers, device_id=torch.device("cpu"))
    return FSDP(model, auto_wrap_policy=functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block}),
                backward_prefetch=BackwardPrefetch[backward] if backward else None, forward_prefetch=forward,
                limit_all_gathers=limit_all_gathers)


def on_ranks(fn, *args, world_size: int):
    """Rank 0's result of ``fn(*args)`` on ``world_size`` ranks; 1 rank: in this process, whose 1-rank group
    must exist already (notebook 02's first cell makes one)."""
    if world_size == 1:
        if not dist.is_initialized() or dist.get_world_size() != 1:
            raise RuntimeError("on_ranks(world_size=1) runs here, in a 1-rank process group: none is initialised")
        return fn(*args)
    from minifsdp.launch import spawn

    return spawn(fn, args, world_size=world_size, timeout_s=300)[0]
