"""``python -m minifsdp bench overlap`` and ``bench precision``: measured, against torch FSDP1, in one run.

overlap: for each prefetch setting (none, BACKWARD_PRE, BACKWARD_POST, forward+BACKWARD_PRE)
    ours: step time, exposed communication per step (tracer: time the compute waited on an
          all-gather / reduce-scatter), peak memory (MemoryTracker), with/without limit_all_gathers
    torch FSDP1, same settings: step time, peak memory
    printed as ratios: ours/torch step time, exposed(setting)/exposed(none).
precision: fp32, bf16 and fp16 MixedPrecision, and activation checkpointing (each on our FSDP and
    on torch FSDP1): step time and peak memory split into parameters / gradients / activations.

Timing: the settings take turns step by step (round-robin after one warm-up step each), so a
noisy minute hits all of them alike; median step time, max over ranks.  Threads: ``--threads``
intra-op threads per rank (gloo's own threads come on top of these).

Measured (2026-12-02, 2 ranks on a 2-core AVX512-BF16 CPU shared with other jobs, load 6-14;
``--config small --batch-size 8 --steps 12 --threads 1``, three runs):

    exposed communication vs no prefetch   BACKWARD_PRE 0.51-1.08   BACKWARD_POST 0.72-0.95
                                           forward+BACKWARD_PRE 0.32-0.49 (the forward's AGs dominate)
    step time vs no prefetch               ours forward+BACKWARD_PRE 0.73-0.91; torch FSDP1 0.98-1.03
    peak memory                            BACKWARD_PRE +3% (one more block's full params);
                                           limit_all_gathers: no change; ours = torch FSDP1 exactly
    --threads 2 (4 compute threads on 2 cores): exposed 0.50 but step time 1.09x: no gain
    precision (batch 8) vs fp32            bf16 peak 0.59, activations 0.50, step 0.61 (ours) / 0.62 (torch)
                                           fp16 peak 0.59, step 9.3x (no fp16 matmul on this CPU)
                                           checkpointing peak 0.54 (ours) / 0.51 (torch), step 1.10 / 1.24

Why torch FSDP1's prefetch gives nothing on CPU: its all-gather is synchronous
(``_flat_param.py``: ``dist.all_gather_into_tensor`` without ``async_op``; its overlap comes
from CUDA streams, which are no-ops on CPU), so prefetching only moves a blocking call.

Note: the numbers are for this machine; the same command runs on a GPU box unchanged
(FSDP here is CPU/gloo; the method, not the figures, carries over).
"""

from __future__ import annotations

import json
import os
import statistics
import time

import torch
import torch.distributed as dist

from minifsdp.fsdp.core.units import units_with_params
from minifsdp.launch import spawn

__all__ = ["run_bench", "overlap_worker", "precision_worker"]

SETTINGS = {"none": (None, False), "BACKWARD_PRE": ("BACKWARD_PRE", False),
            "BACKWARD_POST": ("BACKWARD_POST", False), "forward+BACKWARD_PRE": ("BACKWARD_PRE", True)}


def _config(name):
    from minifsdp.models import GPTConfig

    return {"tiny": GPTConfig.tiny, "small": GPTConfig.small, "bench": GPTConfig.bench}[name]()


def _build(torch_side: bool, cfg, setting=None, limit=True, mp=None, ac=False):
    from functools import partial

    from minifsdp.models import Block, TinyGPT

    bp, fwd = SETTINGS[setting or "none"]
    if torch_side:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
            CheckpointImpl,
            apply_activation_checkpointing,
            checkpoint_wrapper,
        )
        from torch.distributed.fsdp import BackwardPrefetch, MixedPrecision
        from torch.distributed.fsdp import FullyShardedDataParallel as TFSDP
        from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
        model = TFSDP(TinyGPT(cfg, seed=0), auto_wrap_policy=partial(transformer_auto_wrap_policy,
                                                                      transformer_layer_cls={Block}),
                      backward_prefetch=BackwardPrefetch[bp] if bp else None, forward_prefetch=fwd,
                      limit_all_gathers=limit, device_id=torch.device("cpu"),
                      mixed_precision=MixedPrecision(param_dtype=mp, reduce_dtype=mp) if mp else None)
        if ac:
            apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, Block), checkpoint_wrapper_fn=
                                           partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT))
        return model
    from minifsdp.fsdp.activation_checkpointing import apply_activation_checkpointing
    from minifsdp.fsdp.core.mixed_precision import MixedPrecision
    from minifsdp.fsdp.core.prefetch import BackwardPrefetch
    from minifsdp.fsdp.core.wrap import transformer_auto_wrap_policy
    from minifsdp.fsdp.fully_sharded import FSDP
    model = FSDP(TinyGPT(cfg, seed=0), auto_wrap_policy=partial(transformer_auto_wrap_policy,
                                                                 transformer_layer_cls={Block}),
                 backward_prefetch=BackwardPrefetch[bp] if bp else None, forward_prefetch=fwd,
                 limit_all_gathers=limit,
                 mixed_precision=MixedPrecision(param_dtype=mp, reduce_dtype=mp) if mp else None)
    if ac:
        apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, Block))
    return model


def _step_fn(model, batch_size, cfg):
    from minifsdp.models import CharCorpus

    corpus, rank, world = CharCorpus(), dist.get_rank(), dist.get_world_size()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    state = {"i": 0}

    def step():
        x, y = corpus.batch(state["i"], batch_size, cfg.block_size, rank, world)
        x, y = x.remainder(cfg.vocab_size), y.remainder(cfg.vocab_size)
        state["i"] += 1
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
    return step, opt


def _peak(model, opt, step) -> dict:
    from minifsdp.memory.tracker import MemoryTracker, without_resident

    with MemoryTracker(model, opt) as mt:
        step()
    return without_resident(mt.breakdown_at_peak)  # the other settings' models are alive too


def _timed(entries: dict, steps: int) -> dict:
    """Round-robin timing of several step functions; returns {name: median seconds (max over ranks)}."""
    times = {k: [] for k in entries}
    for _ in range(steps):
        for name, step in entries.items():
            dist.barrier()
            t0 = time.perf_counter()
            step()
            dt = torch.tensor([time.perf_counter() - t0])
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)
            times[name].append(dt.item())
    return {k: statistics.median(v) for k, v in times.items()}


class _LinkDelayedWork:
    """A collective on a simulated slow link: done no earlier than ``delay_s`` after it was issued.

    Models wire time that costs no CPU (a real network, or NVLink under NCCL): the
    wait only sleeps for what is left of the delay, so work done meanwhile hides it.
    """

    def __init__(self, work, delay_s: float):
        self.work, self.ready_at = work, time.perf_counter() + delay_s

    def wait(self):
        self.work.wait()
        left = self.ready_at - time.perf_counter()
        if left > 0:
            time.sleep(left)
        return True


class LinkDelayedComm:
    """FSDP's collectives (``minifsdp.comm.get_collectives``) with ``delay_s`` of simulated wire time on each."""

    def __init__(self, comm, delay_s: float):
        self.comm, self.delay_s = comm, delay_s

    def all_gather(self, out, inp, group=None, async_op: bool = False):
        return _LinkDelayedWork(self.comm.all_gather(out, inp, group=group, async_op=async_op), self.delay_s)

    def reduce_scatter(self, out, inp, op="sum", group=None, async_op: bool = False):
        return _LinkDelayedWork(self.comm.reduce_scatter(out, inp, op=op, group=group, async_op=async_op),
                                self.delay_s)

    def all_reduce(self, t, op="sum", group=None, async_op: bool = False):
        return _LinkDelayedWork(self.comm.all_reduce(t, op=op, group=group, async_op=async_op), self.delay_s)


def overlap_worker(config: str, steps: int, batch_size: int, link_ms: float = 0.0) -> dict:
    """``link_ms > 0``: ours only, every collective on a simulated link of that wire time (LinkDelayedComm)."""
    from minifsdp.tools.tracing import Tracer

    cfg = _config(config)
    models, steps_fns, out = {}, {}, {}
    sides = ("ours",) if link_ms > 0 else ("ours", "torch")
    for setting in SETTINGS:
        for side in sides:
            models[(side, setting)] = _build(side == "torch", cfg, setting)
            if side == "ours" and link_ms > 0:
                for unit in units_with_params(models[(side, setting)]):
                    unit.comm = unit._handle.comm = LinkDelayedComm(unit._handle.comm, link_ms / 1e3)
            steps_fns[(side, setting)], _ = _step_fn(models[(side, setting)], batch_size, cfg)
            steps_fns[(side, setting)]()  # warm-up (records the execution order)
    out["step_s"] = {f"{s}/{k}": v for (s, k), v in _timed(steps_fns, steps).items()}
    block_numel = sum(p.numel() for p in _build(False, cfg).module.blocks[0].parameters()) * dist.get_world_size()
    out["allgather_cpu"] = comm_cpu_share(block_numel)
    per_step = {s: [] for s in SETTINGS}  # exposed communication, ours: median over steps, settings interleaved
    for _ in range(steps):
        for setting in SETTINGS:
            dist.barrier()
            with Tracer(models[("ours", setting)]) as tr:
                steps_fns[("ours", setting)]()
            per_step[setting].append(tr.exposed_seconds())
    out["exposed_s"] = {s: {c: statistics.median(e[c] for e in v) for c in v[0]} for s, v in per_step.items()}
    for setting in SETTINGS:  # peak memory of each setting, with and without limit_all_gathers
        for limit in (True, False):
            for side in sides:
                model = _build(side == "torch", cfg, setting, limit=limit)
                step, opt = _step_fn(model, batch_size, cfg)
                step()
                out.setdefault("peak", {})[f"{side}/{setting},limit={limit}"] = _peak(model, opt, step)
    return out


def comm_cpu_share(numel: int, repeats: int = 20) -> dict:
    """How much CPU a gloo all-gather of one unit burns: process CPU seconds per wall second.

    ~1 or more means the collective is CPU work (copies through the loopback), not wire time:
    on cores that are already busy computing, running it "in the background" cannot be free.
    """
    world = dist.get_world_size()
    shard, full = torch.randn(numel // world), torch.empty(numel // world * world)
    dist.all_gather_into_tensor(full, shard)
    dist.barrier()
    wall0, cpu0 = time.perf_counter(), time.process_time()
    for _ in range(repeats):
        dist.all_gather_into_tensor(full, shard)
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    return dict(numel=numel, ms_per_allgather=round(wall / repeats * 1e3, 3), cpu_per_wall=round(cpu / wall, 3))


def precision_worker(config: str, steps: int, batch_size: int) -> dict:
    cfg = _config(config)
    variants = {"fp32": {}, "bf16": dict(mp=torch.bfloat16), "fp16": dict(mp=torch.float16),
                "fp32+ckpt": dict(ac=True), "bf16+ckpt": dict(mp=torch.bfloat16, ac=True)}
    fns, out = {}, {"peak": {}}
    for name, kw in variants.items():
        for side in ("ours", "torch"):
            model = _build(side == "torch", cfg, **kw)
            step, opt = _step_fn(model, batch_size, cfg)
            step()
            out["peak"][f"{side}/{name}"] = _peak(model, opt, step)
            fns[f"{side}/{name}"] = step
    out["step_s"] = _timed(fns, steps)
    return out


def _ratio(a, b):
    return round(a / b, 3) if b else None


def _run(kind: str, args) -> int:
    worker = overlap_worker if kind == "overlap" else precision_worker
    extra = (args.link_ms,) if kind == "overlap" else ()
    t0 = time.time()
    res = spawn(worker, args=(args.config, args.steps, args.batch_size) + extra, world_size=args.world_size,
                threads_per_rank=args.threads, timeout_s=1800)
    r0 = res[0]
    summary = {"config": args.config, "world_size": args.world_size, "threads_per_rank": args.threads,
               "link_ms": getattr(args, "link_ms", 0.0),
               "batch_size": args.batch_size, "steps": args.steps, "cpus": os.cpu_count(), "rank0": r0,
               "peak_by_rank": [r["peak"] for r in res]}
    st = r0["step_s"]
    names = sorted({k.split("/", 1)[1] for k in st})
    sides = sorted({k.split("/", 1)[0] for k in st})
    if "torch" in sides:
        summary["ours_over_torch_step_time"] = {n: _ratio(st[f"ours/{n}"], st[f"torch/{n}"]) for n in names}
        summary["ours_over_torch_peak"] = {n: _ratio(r0["peak"][f"ours/{n}"]["total"],
                                                     r0["peak"][f"torch/{n}"]["total"])
                                           for n in {k.split("/", 1)[1] for k in r0["peak"]}}
    if kind == "overlap":
        ex = r0["exposed_s"]
        base = sum(ex["none"].values())
        summary["exposed_over_none"] = {k: _ratio(sum(v.values()), base) for k, v in ex.items()}
        summary["step_time_over_none"] = {side: {n: _ratio(st[f"{side}/{n}"], st[f"{side}/none"]) for n in names}
                                          for side in sides}
    else:
        for side in ("ours", "torch"):
            p = r0["peak"]
            summary.setdefault("vs_fp32", {})[side] = {
                n: dict(peak=_ratio(p[f"{side}/{n}"]["total"], p[f"{side}/fp32"]["total"]),
                        activations=_ratio(p[f"{side}/{n}"]["activations"], p[f"{side}/fp32"]["activations"]),
                        step_time=_ratio(st[f"{side}/{n}"], st[f"{side}/fp32"]))
                for n in names}
    summary["wall_s"] = round(time.time() - t0, 1)
    text = json.dumps(summary, indent=1, default=str)
    print(text)
    if args.json:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w") as f:
            f.write(text)
    return 0


def run_bench(args) -> int:
    """``bench overlap`` / ``bench precision`` (cli.py): world size = the first of ``--world-sizes``."""
    args.world_size = int(str(args.world_sizes).split(",")[0])
    args.link_ms = getattr(args, "link_ms", 0.0) or 0.0
    return _run(args.what, args)
