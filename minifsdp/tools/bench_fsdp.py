"""``python -m minifsdp bench fsdp``: our FSDP against torch's FSDP1, FSDP2 and DDP, in the same run.

Five trainers of the same TinyGPT (``GPTConfig.bench()``: 19.0M parameters, each
``Block`` its own unit, AdamW), built side by side in every rank of one spawn:

    ours_torch   minifsdp FSDP, FULL_SHARD, torch.distributed's collectives
    ours_ring    minifsdp FSDP, FULL_SHARD, our ring collectives (minifsdp.comm.collectives)
    fsdp1        torch FullyShardedDataParallel, FULL_SHARD          <- the reference (ratio 1.00)
    fsdp2        torch fully_shard (reshard_after_forward=True)
    ddp          torch DistributedDataParallel (gradient_as_bucket_view=True)

Step time.  After ``--warmup`` steps each, the trainers take turns (the order
rotates every repeat, so none is always first), each step timed as

    barrier -> t0 -> zero_grad, forward, backward, optimizer.step -> t1
    time = max over ranks of (t1 - t0)          (the step is done when the slowest rank is)

and we keep the median of ``--steps`` repeats.  The CPU time of the step
(``time.process_time``, all threads of the rank, max over ranks) is kept too:
on a machine shared with other work it is steadier than the wall clock.  Peak memory: one more step per
trainer under :class:`minifsdp.memory.MemoryTracker` (tensor bytes per rank, the
same tracker for all five; not timed, the tracker slows every op).

Every figure is printed as a ratio to torch FSDP1, measured in the same
processes and minutes: the only kind of performance claim the book makes.

Note: on a laptop the ranks share a few cores (4 ranks on 2 cores run at half
speed each) and every link is the loopback interface; compute dominates, so
the ratios are what to read, not the milliseconds.
"""

from __future__ import annotations

import functools
import os
import statistics
import time

import torch
import torch.distributed as dist

from minifsdp.launch import spawn
from minifsdp.memory.tracker import MemoryTracker, snapshot
from minifsdp.models import Block, CharCorpus, GPTConfig, TinyGPT
from minifsdp.tools.bench import load_average, write_bench_json

__all__ = ["run_fsdp_bench", "TRAINERS", "CONFIGS", "bench_rank", "format_table"]

TRAINERS = ("ours_torch", "ours_ring", "fsdp1", "fsdp2", "ddp")
REFERENCE = "fsdp1"
CONFIGS = {"bench": GPTConfig.bench, "small": GPTConfig.small, "tiny": GPTConfig.tiny}
AIMS = {"ours_torch": 1.1, "ours_ring": 1.5}  # step-time ratio to FSDP1 we aim for; memory: within 5%
MEMORY_AIM = 0.05


def _wrap(name: str, model: torch.nn.Module) -> torch.nn.Module:
    """Wrap ``model`` (a TinyGPT) as trainer ``name``; every FSDP wraps each Block as its own unit."""
    if name.startswith("ours_"):
        from minifsdp.fsdp.fully_sharded import FullyShardedDataParallel
        from minifsdp.fsdp.wrap import transformer_auto_wrap_policy

        policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})
        return FullyShardedDataParallel(model, auto_wrap_policy=policy, collectives=name[len("ours_"):])
    if name == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel
        from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

        policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})
        return FullyShardedDataParallel(model, auto_wrap_policy=policy, device_id=torch.device("cpu"))
    if name == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        return fully_shard(model, mesh=mesh)
    if name == "ddp":
        return torch.nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=True)
    raise ValueError(f"unknown trainer {name!r}; choose from {TRAINERS}")


def _step(model, opt, x, y) -> None:
    opt.zero_grad(set_to_none=True)
    model(x, y).backward()
    opt.step()


def _timed_step(model, opt, x, y) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of one step, each the max over ranks."""
    dist.barrier()
    t0, c0 = time.perf_counter(), time.process_time()
    _step(model, opt, x, y)
    elapsed = torch.tensor([time.perf_counter() - t0, time.process_time() - c0], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed[0].item(), elapsed[1].item()


def bench_rank(config: str, names: list[str], batch_size: int, warmup: int, steps: int) -> dict:
    """One rank: build every trainer, time them in turns, then measure each one's peak memory."""
    rank, world = dist.get_rank(), dist.get_world_size()
    say = (lambda msg: print(f"  [N={world}] {msg}", flush=True)) if rank == 0 else (lambda msg: None)
    cfg = CONFIGS[config]()
    corpus = CharCorpus()
    models, opts = {}, {}
    for name in names:
        models[name] = _wrap(name, TinyGPT(cfg, seed=0))
        opts[name] = torch.optim.AdamW(models[name].parameters(), lr=1e-4)
    say(f"built {', '.join(names)}; warm-up ({warmup} step(s) each) ...")
    times: dict[str, list[float]] = {name: [] for name in names}
    cpu: dict[str, list[float]] = {name: [] for name in names}
    for i in range(warmup + steps):
        x, y = corpus.batch(i, batch_size, cfg.block_size, rank, world)
        order = names[i % len(names):] + names[: i % len(names)]  # rotate: nobody is always first
        for name in order:
            seconds, cpu_seconds = _timed_step(models[name], opts[name], x, y)
            if i >= warmup:
                times[name].append(seconds)
                cpu[name].append(cpu_seconds)
        if i >= warmup:
            say(f"step {i - warmup + 1}/{steps}: " + ", ".join(f"{n} {times[n][-1] * 1e3:.0f} ms" for n in names))
        else:
            say(f"warm-up step {i + 1}/{warmup} done")
    say("peak memory: one tracked step each ...")
    memory = {}
    x, y = corpus.batch(warmup + steps, batch_size, cfg.block_size, rank, world)
    for name in names:
        rest = snapshot(models[name], opts[name])
        with MemoryTracker(models[name], opts[name]) as mt:
            _step(models[name], opts[name], x, y)
        memory[name] = {"peak_bytes": mt.peak_bytes, "model_state_bytes": rest["parameters"] + rest["gradients"]
                        + rest["optimizer_state"], "at_peak": mt.breakdown_at_peak}
    return {"times": times, "cpu": cpu, "memory": memory}


def summarize(world: int, results: list[dict], names: list[str]) -> list[dict]:
    """One row per trainer: median step time, peak bytes (max over ranks), both as ratios to FSDP1."""
    times = results[0]["times"]  # already the max over ranks, step by step
    rows = []
    for name in names:
        peaks = [r["memory"][name]["peak_bytes"] for r in results]
        rows.append({"world_size": world, "trainer": name, "step_s": statistics.median(times[name]),
                     "step_times_s": times[name], "cpu_s": statistics.median(results[0]["cpu"][name]),
                     "cpu_times_s": results[0]["cpu"][name], "peak_bytes": max(peaks), "peak_bytes_per_rank": peaks,
                     "model_state_bytes": max(r["memory"][name]["model_state_bytes"] for r in results),
                     "at_peak_rank0": results[0]["memory"][name]["at_peak"]})
    ref = next((r for r in rows if r["trainer"] == REFERENCE), None)
    for r in rows:
        r["time_ratio"] = r["step_s"] / ref["step_s"] if ref else None
        r["cpu_ratio"] = r["cpu_s"] / ref["cpu_s"] if ref else None
        r["peak_ratio"] = r["peak_bytes"] / ref["peak_bytes"] if ref else None
    return rows


def format_table(rows: list[dict]) -> str:
    head = (f"{'N':>2} {'trainer':<11} {'step ms':>9} {'x FSDP1':>8} {'cpu ms':>9} {'x FSDP1':>8} "
            f"{'peak MB':>9} {'x FSDP1':>8} {'state MB':>9}  aim")
    lines = [head]
    for r in rows:
        aim = ""
        if r["trainer"] in AIMS and r["time_ratio"] is not None:
            ok_t = r["time_ratio"] <= AIMS[r["trainer"]]
            ok_m = abs(r["peak_ratio"] - 1) <= MEMORY_AIM
            aim = (f"time <= {AIMS[r['trainer']]}x: {'ok' if ok_t else 'MISSED'}; "
                   f"peak within 5%: {'ok' if ok_m else 'MISSED'}")
        ratio = lambda v: f"{v:>8.3f}" if v is not None else f"{'-':>8}"  # noqa: E731
        lines.append(f"{r['world_size']:>2} {r['trainer']:<11} {r['step_s'] * 1e3:>9.1f} {ratio(r['time_ratio'])} "
                     f"{r['cpu_s'] * 1e3:>9.1f} {ratio(r['cpu_ratio'])} "
                     f"{r['peak_bytes'] / 2**20:>9.2f} {ratio(r['peak_ratio'])} "
                     f"{r['model_state_bytes'] / 2**20:>9.2f}  {aim}")
    return "\n".join(lines)


def run_fsdp_bench(args) -> int:
    """Entry point (args: world_sizes, steps, warmup, batch_size, config, trainers, json)."""
    world_sizes = [int(w) for w in str(args.world_sizes).split(",") if w.strip()]
    if not world_sizes or any(w < 2 for w in world_sizes):
        raise SystemExit(f"--world-sizes must list sizes >= 2, e.g. 2,4; got {args.world_sizes!r}")
    if args.steps < 1 or args.warmup < 0 or args.batch_size < 1:
        raise SystemExit("--steps and --batch-size must be >= 1 and --warmup >= 0")
    names = [n.strip() for n in str(args.trainers).split(",") if n.strip()]
    unknown = [n for n in names if n not in TRAINERS]
    if unknown or not names:
        raise SystemExit(f"--trainers: unknown {unknown}; choose from {','.join(TRAINERS)}")
    if args.config not in CONFIGS:
        raise SystemExit(f"--config must be one of {sorted(CONFIGS)}, got {args.config!r}")
    cfg = CONFIGS[args.config]()
    n_params = sum(p.numel() for p in TinyGPT(cfg, seed=0).parameters())
    print(f"minifsdp bench fsdp: TinyGPT {args.config} ({n_params / 1e6:.2f}M parameters, {cfg.n_layer} blocks, "
          f"each its own unit), AdamW, batch {args.batch_size} x {cfg.block_size} tokens per rank, "
          f"{args.warmup} warm-up + {args.steps} timed steps; trainers {', '.join(names)}", flush=True)
    rows, started = [], time.perf_counter()
    for n in world_sizes:
        print(f"world size {n}: one spawn, {len(names)} trainers ...", flush=True)
        results = spawn(bench_rank, args=(args.config, names, args.batch_size, args.warmup, args.steps),
                        world_size=n, timeout_s=3600, threads_per_rank=1)
        rows += summarize(n, results, names)
    print(format_table(rows))
    print(f"({time.perf_counter() - started:.0f} s; ratios are to torch FSDP1 in the same run: below 1 is faster / "
          f"smaller; load average {load_average():.1f} on {os.cpu_count()} CPUs: other work makes times noisy)")
    if args.json:
        write_bench_json(args.json, rows, threads_per_rank=1, config=args.config, n_params=n_params,
                         batch_size=args.batch_size, block_size=cfg.block_size, warmup=args.warmup,
                         steps=args.steps, reference=REFERENCE)
        print(f"wrote {args.json}")
    return 0
