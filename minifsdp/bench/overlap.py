"""``python -m minifsdp bench overlap`` and ``bench precision``: measured, against torch FSDP1, in one run.

overlap: for each prefetch setting (none, BACKWARD_PRE, BACKWARD_POST, forward+BACKWARD_PRE)
    ours: step time, exposed communication per step (tracer: time the compute waited on an
          all-gather / reduce-scatter), peak memory (MemoryTracker), with/without limit_all_gathers
    torch FSDP1, same settings: step time, peak memory
    printed as ratios: ours/torch step time, exposed(setting)/exposed(none).
precision: fp32, bf16 and fp16 MixedPrecision, and activation checkpointing (each on our FSDP and
    on torch FSDP1): step time and peak memory split into parameters / gradients / activations.

Timing: after one warm-up step each, one round of the bench harness (:mod:`minifsdp.bench.
harness`: turns, each time the slowest rank's, the median) is one step of each setting.  Threads: ``--threads``
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

import itertools
import os
import statistics
import time

import torch
import torch.distributed as dist

from minifsdp.bench import harness
from minifsdp.bench.fsdp import CONFIGS, FSDP1, fsdp1
from minifsdp.bench.step_costs import PREFETCH as SETTINGS
from minifsdp.comm.collectives import TorchCollectives
from minifsdp.memory.tracker import MemoryTracker, without_resident
from minifsdp.models import Block, CharCorpus, TinyGPT
from minifsdp.pictures.tracing import Tracer

__all__ = ["run_bench", "overlap_worker", "precision_worker"]

def _build(torch_side: bool, cfg, setting=None, limit=True, mp=None, ac=False):
    """A TinyGPT (seed 0) under torch FSDP1 or ours, each Block a unit, with the prefetch ``setting``,
    ``limit_all_gathers``, MixedPrecision(``mp``, ``mp``) and activation checkpointing of each Block (``ac``)."""
    side, (bp, fwd) = "torch" if torch_side else "ours", SETTINGS[setting or "none"]
    api = FSDP1[side]
    model = fsdp1(side, TinyGPT(cfg, seed=0), forward_prefetch=fwd, limit_all_gathers=limit,
                  backward_prefetch=api.BackwardPrefetch[bp] if bp else None,
                  mixed_precision=api.MixedPrecision(param_dtype=mp, reduce_dtype=mp) if mp else None,
                  **({"device_id": torch.device("cpu")} if torch_side else {}))
    if ac:
        api.checkpointing(model, check_fn=lambda m: isinstance(m, Block))
    return model


def _step_fn(model, batch_size, cfg):
    corpus, rank, world = CharCorpus(), dist.get_rank(), dist.get_world_size()
    opt, batches = torch.optim.AdamW(model.parameters(), lr=1e-3), itertools.count()

    def step():
        x, y = corpus.batch(next(batches), batch_size, cfg.block_size, rank, world)
        model(x.remainder(cfg.vocab_size), y.remainder(cfg.vocab_size)).backward()
        opt.step()
        opt.zero_grad()
    return step, opt


def _peak(model, opt, step) -> dict:
    with MemoryTracker(model, opt) as mt:
        step()
    return without_resident(mt.breakdown_at_peak)  # the other settings' models are alive too


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


def delay_links(delay_s: float) -> None:
    """In this process, every collective of ours on torch.distributed (``collectives="torch"``, FSDP's default:
    :class:`minifsdp.comm.TorchCollectives`) on a simulated link of ``delay_s`` wire time each.  Torch FSDP1
    does not use these methods: only ours is delayed (and a rank of a bench run is a process of its own)."""
    for name in ("all_gather", "reduce_scatter", "all_reduce"):
        collective = getattr(TorchCollectives, name)
        setattr(TorchCollectives, name, lambda self, *args, _collective=collective, **kwargs:
                _LinkDelayedWork(_collective(self, *args, **kwargs), delay_s))


def overlap_worker(config: str, steps: int, batch_size: int, link_ms: float = 0.0) -> dict:
    """``link_ms > 0``: ours only, every collective on a simulated link of that wire time (:func:`delay_links`)."""
    cfg = CONFIGS[config]()
    models, steps_fns, out = {}, {}, {}
    sides = ("ours",) if link_ms > 0 else ("ours", "torch")
    if link_ms > 0:
        delay_links(link_ms / 1e3)
    for setting in SETTINGS:
        for side in sides:
            models[(side, setting)] = _build(side == "torch", cfg, setting)
            steps_fns[(side, setting)], _ = _step_fn(models[(side, setting)], batch_size, cfg)
            steps_fns[(side, setting)]()  # warm-up (records the execution order)
    timings = harness.interleave(steps_fns, steps)  # the settings and sides in turns
    out["step_s"] = {f"{s}/{k}": timings.median((s, k)) for s, k in steps_fns}
    out["allgather_cpu"] = comm_cpu_share(sum(p.numel() for p in Block(cfg).parameters()) * dist.get_world_size())
    per_step = {s: [] for s in SETTINGS}  # exposed communication, ours: median over steps, settings in turns

    def traced(setting):
        def step():
            with Tracer(models[("ours", setting)]) as tr:
                steps_fns[("ours", setting)]()
            per_step[setting].append(tr.exposed_seconds())
        return step

    harness.interleave({setting: traced(setting) for setting in SETTINGS}, steps)
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
    cfg = CONFIGS[config]()
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
    timings = harness.interleave(fns, steps)  # the variants and sides in turns
    out["step_s"] = {name: timings.median(name) for name in fns}
    return out


def _ratio(a, b):
    r = harness.ratio(a, b)
    return round(r, 3) if r is not None else None


def _run(kind: str, args) -> int:
    worker = overlap_worker if kind == "overlap" else precision_worker
    extra = (args.link_ms,) if kind == "overlap" else ()
    run = harness.BenchRun(f"minifsdp bench {kind}: TinyGPT {args.config}, {args.world_size} ranks, batch "
                           f"{args.batch_size}, {args.steps} timed steps each, ours against torch FSDP1"
                           + (f", {args.link_ms} ms simulated link (ours only)" if args.link_ms else ""))
    res = harness.run_ranks(worker, (args.config, args.steps, args.batch_size) + extra, args.world_size,
                            threads=args.threads, timeout_s=1800)
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
    summary["wall_s"] = round(time.perf_counter() - run.started, 1)
    summary["load_average_1min"] = harness.load_average()
    print(format_table(kind, summary, names))
    run.close("ratios in one run: below 1 is faster / smaller")
    if args.json:
        harness.save_json(args.json, summary)
        print(f"wrote {args.json}")
    return 0


def format_table(kind: str, summary: dict, names: list[str]) -> str:
    """One line per setting: ours against torch FSDP1 (step time, peak), and each against its baseline."""
    peak = summary.get("ours_over_torch_peak", {})
    columns = {"ours/torch step": summary.get("ours_over_torch_step_time", {}),
               "ours/torch peak": {n: peak.get(f"{n},limit=True", peak.get(n)) for n in names if peak},
               "exposed/none": summary.get("exposed_over_none", {})}
    columns.update({f"{side} step/none": v for side, v in summary.get("step_time_over_none", {}).items()})
    for side, by in summary.get("vs_fp32", {}).items():
        columns.update({f"{side} {k.split('_')[0][:5]}/fp32": {n: by[n][k] for n in names} for k in by[names[0]]})
    columns = {h: c for h, c in columns.items() if c}  # what this bench measured
    rows = [{kind: n, **{h: c.get(n) for h, c in columns.items()}} for n in names]
    return harness.table(rows, [(kind, kind, "<21")] + [(h, h, f">{len(h)}.3f") for h in columns])


def run_bench(args) -> int:
    """``bench overlap`` / ``bench precision`` (cli.py): world size = the first of ``--world-sizes``."""
    args.world_size = harness.world_sizes(args.world_sizes)[0]
    args.link_ms = getattr(args, "link_ms", 0.0) or 0.0
    return _run(args.what, args)
