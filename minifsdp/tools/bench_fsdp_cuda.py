"""``python -m minifsdp bench fsdp --device cuda``: ours against torch's FSDP1, FSDP2, DDP and the plain model, on GPUs.

The same TinyGPT, each ``Block`` its own unit, AdamW (lr 1e-4, torch's default ``foreach``), in every rank:

    plain        the unwrapped model (no communication: the floor)
    ours_torch   minifsdp FSDP, FULL_SHARD, torch.distributed's collectives (NCCL)
    fsdp1        torch FullyShardedDataParallel, FULL_SHARD                  <- the reference (ratio 1.00)
    fsdp2        torch fully_shard, each Block then the root                 <- the second reference
    ours_fsdp2   minifsdp fully_shard, as fsdp2                              <- read against fsdp2
    ddp          torch DistributedDataParallel (gradient_as_bucket_view=True)

At world size 1 both FSDP1s run NO_SHARD (torch switches to it, and ours as torch).

Configs (``--config``, a list runs each): the GPU measurements' sizes, and the CPU bench's for a quick check.

    85m    GPTConfig(vocab_size=96, block_size=512,  n_layer=12, n_head=12, n_embd=768)    batch 16 per rank
    300m   GPTConfig(vocab_size=96, block_size=1024, n_layer=24, n_head=16, n_embd=1024)   batch 8 per rank
    bench, small, tiny   (bench_fsdp.CONFIGS)                                            batch 2 per rank

Precision (``--precision``, a list runs each):

    fp32   everything in fp32 (torch's default matmul precision: no TF32)
    bf16   MixedPrecision(param_dtype=bf16, reduce_dtype=fp32) for ours_torch and fsdp1,
           MixedPrecisionPolicy(the same) for fsdp2 and ours_fsdp2, torch.autocast(bf16) for plain and ddp

Each (config, precision) runs in a spawn of its own (fresh processes: nothing one leaves cached reaches the
next), in two passes per rank, after one step of every trainer on the tiny GPT (cuBLAS's handles and
workspaces exist before anything is measured):

  memory   each trainer alone: the one before dropped, ``gc.collect()``, ``empty_cache()``; the baseline is
           ``memory_allocated()`` then.  Wrap, then two steps in phases (forward, backward, optimizer step,
           zero_grad): ``reset_peak_memory_stats()`` before each phase, and after it the allocated bytes and
           ``max_memory_allocated()``, both over the baseline.  The trainer's peak = its largest phase peak.
  time     every trainer built side by side; ``--warmup`` steps each, then ``--steps`` rounds in turns (the
           order rotates each round, so none is always first), each step

               torch.cuda.synchronize() -> t0 -> zero_grad, forward, backward, step -> synchronize() -> t1

           (max over ranks); the median per trainer.

Every figure is also printed as a ratio to torch FSDP1 (and to torch FSDP2) measured in the same spawn: the
only kind of performance claim the book makes.  Not measured here: communication across GPUs (at world size 1
NCCL's collectives are local copies); world sizes above 1 run where the GPUs are, untested on this project's
one-GPU machine.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import gc
import json
import statistics
import time

import torch
import torch.distributed as dist

from minifsdp.launch import RankFailedError, spawn
from minifsdp.models import Block, CharCorpus, GPTConfig, TinyGPT
from minifsdp.tools import bench_fsdp
from minifsdp.tools.bench import write_bench_json
from minifsdp.tools.devices import rank_device, resolve_device, synchronize

__all__ = ["run_fsdp_bench_cuda", "bench_rank", "CONFIGS", "TRAINERS", "PRECISIONS", "summarize", "format_table"]

TRAINERS = ("plain", "ours_torch", "fsdp1", "fsdp2", "ours_fsdp2", "ddp")
PRECISIONS = ("fp32", "bf16")
CONFIGS = {"85m": functools.partial(GPTConfig, vocab_size=96, block_size=512, n_layer=12, n_head=12, n_embd=768),
           "300m": functools.partial(GPTConfig, vocab_size=96, block_size=1024, n_layer=24, n_head=16, n_embd=1024),
           **bench_fsdp.CONFIGS}
DEFAULTS = {"85m": dict(batch_size=16, warmup=5, steps=20), "300m": dict(batch_size=8, warmup=4, steps=12)}
OTHER_DEFAULTS = dict(batch_size=2, warmup=2, steps=8)
MEMORY_STEPS = 2
PHASES = ("forward", "backward", "step", "zero_grad")
REFERENCE, REFERENCE_FSDP2 = bench_fsdp.REFERENCE, bench_fsdp.REFERENCE_FSDP2


def _wrap(name: str, model: torch.nn.Module, device: torch.device, precision: str) -> torch.nn.Module:
    """``model`` (on ``device``) as trainer ``name``; every FSDP wraps each Block as its own unit."""
    bf16 = precision == "bf16"
    if name == "plain":
        return model
    if name == "ddp":
        return torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None, gradient_as_bucket_view=True)
    if name in ("ours_torch", "fsdp1"):
        if name == "fsdp1":
            from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
            from torch.distributed.fsdp import MixedPrecision
            from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

            kwargs = {"device_id": device}
        else:
            from minifsdp.fsdp import FSDP, MixedPrecision, transformer_auto_wrap_policy

            kwargs = {"collectives": "torch"}
        mp = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
        policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})
        return FSDP(model, auto_wrap_policy=policy, mixed_precision=mp, **kwargs)
    if name in ("fsdp2", "ours_fsdp2"):
        from torch.distributed.device_mesh import init_device_mesh

        if name == "fsdp2":
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        else:
            from minifsdp.fsdp2 import MixedPrecisionPolicy, fully_shard
        kw = {"mesh": init_device_mesh(device.type, (dist.get_world_size(),))}
        if bf16:
            kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in model.blocks:
            fully_shard(block, **kw)
        return fully_shard(model, **kw)
    raise ValueError(f"unknown trainer {name!r}; choose from {', '.join(TRAINERS)}")


def _autocast(name: str, device: torch.device, precision: str):
    """bf16 for the trainers without a mixed-precision setting of their own (plain, ddp): torch.autocast."""
    if precision == "bf16" and name in ("plain", "ddp"):
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def _build(name, base, device, precision):
    model = _wrap(name, copy.deepcopy(base).to(device), device, precision)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def _step(name, model, opt, x, y, device, precision) -> None:
    opt.zero_grad(set_to_none=True)
    with _autocast(name, device, precision):
        loss = model(x, y)
    loss.backward()
    opt.step()


class _Memory:
    """``torch.cuda``'s allocated bytes and peaks, over a baseline; zeros on the CPU (the bench's own tests)."""

    def __init__(self, device: torch.device):
        self.device, self.cuda, self.base = device, device.type == "cuda", 0

    def baseline(self) -> None:
        gc.collect()
        if self.cuda:
            synchronize(self.device)
            torch.cuda.empty_cache()
            self.base = torch.cuda.memory_allocated(self.device)

    def begin(self) -> None:
        if self.cuda:
            synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)

    def end(self, step, phase: str) -> dict:
        if not self.cuda:
            return {"step": step, "phase": phase, "allocated": 0, "peak": 0}
        synchronize(self.device)
        return {"step": step, "phase": phase, "allocated": torch.cuda.memory_allocated(self.device) - self.base,
                "peak": torch.cuda.max_memory_allocated(self.device) - self.base}


def memory_alone(name, base, batch, device, precision) -> dict:
    """Build ``name`` with nothing else alive; the allocated bytes and peak of wrap and each phase of two steps."""
    meter = _Memory(device)
    meter.baseline()
    meter.begin()
    model, opt = _build(name, base, device, precision)
    points = [meter.end(None, "wrap")]
    x, y = batch
    for step in range(MEMORY_STEPS):
        meter.begin()
        with _autocast(name, device, precision):
            loss = model(x, y)
        points.append(meter.end(step, "forward"))
        meter.begin()
        loss.backward()
        points.append(meter.end(step, "backward"))
        meter.begin()
        opt.step()
        points.append(meter.end(step, "step"))
        meter.begin()
        opt.zero_grad(set_to_none=True)
        del loss
        points.append(meter.end(step, "zero_grad"))
    del model, opt
    return {"points": points, "peak": max(p["peak"] for p in points)}


def bench_rank(config: str, precision: str, names: list[str], batch_size: int, warmup: int, steps: int,
               device_kind: str) -> dict:
    """One rank of one (config, precision): the memory pass (each trainer alone), then the time pass (in turns)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    device = rank_device(device_kind)
    say = (lambda msg: print(f"  [{config} {precision} N={world}] {msg}", flush=True)) if rank == 0 else \
        (lambda msg: None)
    cfg, corpus = CONFIGS[config](), CharCorpus()
    tiny = GPTConfig.tiny()
    tiny_batch = [t.to(device) for t in corpus.batch(0, 2, tiny.block_size, rank, world)]
    for name in names:  # kernels, handles and workspaces made once, before anything is measured
        model, opt = _build(name, TinyGPT(tiny, seed=0), device, precision)
        _step(name, model, opt, *tiny_batch, device, precision)
        del model, opt
    base = TinyGPT(cfg, seed=0)  # on the CPU; each trainer gets a copy moved to the device
    batches = [[t.to(device) for t in corpus.batch(i, batch_size, cfg.block_size, rank, world)]
               for i in range(min(4, warmup + steps))]
    memory = {}
    for name in names:
        memory[name] = memory_alone(name, base, batches[0], device, precision)
        say(f"memory: {name} alone, peak {memory[name]['peak'] / 2**20:.0f} MB over its baseline")
    gc.collect()
    models = {name: _build(name, base, device, precision) for name in names}
    times: dict[str, list[float]] = {name: [] for name in names}
    for i in range(warmup + steps):
        x, y = batches[i % len(batches)]
        order = names[i % len(names):] + names[: i % len(names)]  # rotate: nobody is always first
        for name in order:
            if world > 1:
                dist.barrier()
            synchronize(device)
            t0 = time.perf_counter()
            _step(name, *models[name], x, y, device, precision)
            synchronize(device)
            if i >= warmup:
                times[name].append(time.perf_counter() - t0)
        if i >= warmup:
            say(f"step {i - warmup + 1}/{steps}: " + ", ".join(f"{n} {times[n][-1] * 1e3:.1f} ms" for n in names))
    slowest = torch.tensor([times[n] for n in names], dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)  # a step is done when the slowest rank is
    del models
    return {"times": {n: slowest[i].tolist() for i, n in enumerate(names)}, "memory": memory,
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}


def summarize(world: int, config: str, precision: str, results: list[dict], names: list[str]) -> list[dict]:
    """One row per trainer: median step time, peak (max over ranks), ratios to torch FSDP1 and FSDP2."""
    rows = []
    for name in names:
        peaks = [r["memory"][name]["peak"] for r in results]
        times = results[0]["times"][name]
        rows.append({"config": config, "precision": precision, "world_size": world, "trainer": name,
                     "step_s": statistics.median(times), "step_times_s": times, "peak_bytes": max(peaks),
                     "peak_bytes_per_rank": peaks, "memory_rank0": results[0]["memory"][name]["points"]})
    ref = next((r for r in rows if r["trainer"] == REFERENCE), None)
    ref2 = next((r for r in rows if r["trainer"] == REFERENCE_FSDP2), None)
    ratio = lambda a, b: a / b if b else None  # noqa: E731
    for r in rows:
        r["time_ratio"] = ratio(r["step_s"], ref["step_s"]) if ref else None
        r["peak_ratio"] = ratio(r["peak_bytes"], ref["peak_bytes"]) if ref else None
        r["time_ratio_fsdp2"] = ratio(r["step_s"], ref2["step_s"]) if ref2 else None
        r["peak_ratio_fsdp2"] = ratio(r["peak_bytes"], ref2["peak_bytes"]) if ref2 else None
    return rows


def _ratio(v) -> str:
    return f"{v:>8.3f}" if v is not None else f"{'-':>8}"


def format_table(rows: list[dict]) -> str:
    """Per trainer: step time and peak, each with its ratios; then each phase's peak (MB over the baseline)."""
    lines = [f"{'N':>2} {'trainer':<11} {'step ms':>9} {'x FSDP1':>8} {'x FSDP2':>8} {'peak MB':>9} {'x FSDP1':>8} "
             f"{'x FSDP2':>8}   phase peaks, MB (wrap | step 1: fwd bwd opt zero | step 2: ...)"]
    for r in rows:
        pts = r["memory_rank0"]
        phases = f"{pts[0]['peak'] / 2**20:.0f} | " + " | ".join(
            " ".join(f"{p['peak'] / 2**20:.0f}" for p in pts if p["step"] == s) for s in range(MEMORY_STEPS))
        lines.append(f"{r['world_size']:>2} {r['trainer']:<11} {r['step_s'] * 1e3:>9.1f} {_ratio(r['time_ratio'])} "
                     f"{_ratio(r['time_ratio_fsdp2'])} {r['peak_bytes'] / 2**20:>9.1f} {_ratio(r['peak_ratio'])} "
                     f"{_ratio(r['peak_ratio_fsdp2'])}   {phases}")
    return "\n".join(lines)


def _pair(row: dict | None, time_key: str, peak_key: str) -> str:
    if row is None or row.get(time_key) is None or row.get(peak_key) is None:
        return f"{'-':>5} {'-':>5}"
    return f"{row[time_key]:>5.3f} {row[peak_key]:>5.3f}"


def format_summary(rows: list[dict], names: list[str]) -> str:
    """One line per (config, precision, N): each trainer's step time as a ratio to torch FSDP1 (FSDP1's own in ms),
    then the two pairs the book reads: ours FSDP / torch FSDP1 and ours fully_shard / torch FSDP2, time and peak."""
    head = f"{'config':<6} {'prec':<5} {'N':>2} " + " ".join(f"{n:>10}" for n in names) + \
        "   ours/FSDP1 time peak   ours_fsdp2/FSDP2 time peak"
    lines = ["step time x torch FSDP1 (FSDP1's own in ms), and the two pairs:", head]
    ok = [r for r in rows if "trainer" in r]
    for key in dict.fromkeys((r["config"], r["precision"], r["world_size"]) for r in ok):
        mine = {r["trainer"]: r for r in ok if (r["config"], r["precision"], r["world_size"]) == key}
        cells = []
        for n in names:
            r = mine.get(n)
            cells.append(f"{'-':>10}" if r is None or r["time_ratio"] is None else
                         f"{r['step_s'] * 1e3:>7.1f} ms" if n == REFERENCE else f"{r['time_ratio']:>10.3f}")
        lines.append(f"{key[0]:<6} {key[1]:<5} {key[2]:>2} " + " ".join(cells) +
                     f"   {'':>5}{_pair(mine.get('ours_torch'), 'time_ratio', 'peak_ratio')}"
                     f"   {'':>11}{_pair(mine.get('ours_fsdp2'), 'time_ratio_fsdp2', 'peak_ratio_fsdp2')}")
    lines += [f"{r['config']} {r['precision']} N={r['world_size']}: FAILED ({r['error'].strip().splitlines()[-1]})"
              for r in rows if "error" in r]
    return "\n".join(lines)


def _list(value, allowed, what: str) -> list[str]:
    items = [v.strip() for v in str(value).split(",") if v.strip()]
    bad = [v for v in items if v not in allowed]
    if bad or not items:
        raise SystemExit(f"{what}: unknown {bad or value!r}; choose from {','.join(allowed)}")
    return items


def run_fsdp_bench_cuda(args) -> int:
    """Entry point (cli.py, ``bench fsdp --device cuda``): every (config, precision) at every world size."""
    configs = _list(args.config or "85m", CONFIGS, "--config")
    precisions = _list(args.precision or "fp32", PRECISIONS, "--precision")
    names = _list(args.trainers or ",".join(TRAINERS), TRAINERS, "--trainers (ours_ring is for gloo: not on cuda)")
    world_sizes = [int(w) for w in str(args.world_sizes or "1").split(",") if w.strip()]
    if not world_sizes or any(w < 1 for w in world_sizes):
        raise SystemExit(f"--world-sizes must list sizes >= 1, e.g. 1 or 1,2; got {args.world_sizes!r}")
    for name in ("steps", "warmup", "batch_size"):
        value = getattr(args, name, None)
        if value is not None and value < (0 if name == "warmup" else 1):
            raise SystemExit("--steps and --batch-size must be >= 1 and --warmup >= 0")
    placement = resolve_device("cuda", max(world_sizes))
    json_path = "out/bench_fsdp_cuda.json" if args.json is None else args.json
    print(f"minifsdp bench fsdp --device cuda: {placement.describe()}; configs {', '.join(configs)}; precision "
          f"{', '.join(precisions)}; world sizes {', '.join(map(str, world_sizes))}; trainers {', '.join(names)}; "
          f"torch {torch.__version__}, CUDA {torch.version.cuda}", flush=True)
    rows, failed, started = [], False, time.perf_counter()
    for config in configs:
        cfg = CONFIGS[config]()
        plan = {k: getattr(args, k, None) if getattr(args, k, None) is not None else v
                for k, v in DEFAULTS.get(config, OTHER_DEFAULTS).items()}
        with torch.device("meta"):  # shapes only: a 300M model's init on the CPU takes seconds
            n_params = sum(p.numel() for p in TinyGPT(cfg, seed=0).parameters())
        for precision in precisions:
            for n in world_sizes:
                print(f"{config} ({n_params / 1e6:.1f}M parameters, {cfg.n_layer} x {cfg.n_embd}, T={cfg.block_size}, "
                      f"batch {plan['batch_size']} per rank), {precision}, world size {n}: {plan['warmup']} warm-up + "
                      f"{plan['steps']} timed steps per trainer ...", flush=True)
                t0 = time.perf_counter()
                try:
                    results = spawn(bench_rank, args=(config, precision, names, plan["batch_size"], plan["warmup"],
                                                      plan["steps"], "cuda"),
                                    world_size=n, backend=placement.backend, timeout_s=1200, threads_per_rank=None)
                except RankFailedError as e:  # say so, keep what the other runs measure
                    failed = True
                    print(f"FAILED: {config} {precision} N={n}:\n{e}", flush=True)
                    rows.append({"config": config, "precision": precision, "world_size": n, "error": str(e)})
                else:
                    mine = summarize(n, config, precision, results, names)
                    for r in mine:
                        r.update(n_params=n_params, wall_s=time.perf_counter() - t0, **plan)
                    rows += mine
                    print(format_table(mine), flush=True)
                if json_path:  # after every run: what was measured survives a later failure
                    write_bench_json(json_path, rows, device=placement.describe(), cuda=torch.version.cuda,
                                     world_sizes=world_sizes, trainers=names, reference=REFERENCE,
                                     reference_fsdp2=REFERENCE_FSDP2)
    print(format_summary(rows, names))
    print(f"({time.perf_counter() - started:.0f} s; ratios to torch FSDP1 / FSDP2 in the same spawn: below 1 is faster "
          f"/ smaller; peak = the largest phase peak of memory_allocated over the trainer's baseline, each alone)")
    if json_path:
        print(f"wrote {json_path}")
    return 1 if failed else 0


def load_rows(path: str) -> list[dict]:
    """The rows of a JSON this bench wrote (for plots and the book)."""
    with open(path) as f:
        return json.load(f)["rows"]

