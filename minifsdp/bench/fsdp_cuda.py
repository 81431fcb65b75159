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
    bench, small, tiny   (fsdp.py's CONFIGS)                                          batch 2 per rank

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
  time     every trainer built side by side (``fsdp.wrap``, ``bench/fsdp.py``: the CPU bench's); ``--warmup``
           steps each, then ``--steps`` rounds of the bench harness (``harness.interleave``: turns,
           each time the slowest rank's), each step timed as

               torch.cuda.synchronize() -> t0 -> zero_grad, forward, backward, step -> synchronize() -> t1

           and the median per trainer.

Every figure is also printed as a ratio to torch FSDP1 (and to torch FSDP2) measured in the same spawn: the
only kind of performance claim the book makes.  Not measured here: communication across GPUs (at world size 1
NCCL's collectives are local copies); world sizes above 1 run where the GPUs are, untested on this project's
one-GPU machine.
"""

from __future__ import annotations

import copy
import functools
import gc
import statistics
import time

import torch
import torch.distributed as dist

from minifsdp.bench import fsdp as bench_fsdp
from minifsdp.bench import harness
from minifsdp.launch import RankFailedError
from minifsdp.models import CharCorpus, GPTConfig, TinyGPT
from minifsdp.training.devices import rank_device, resolve_device, synchronize

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
    model, opt = bench_fsdp.build(name, copy.deepcopy(base), device, precision)
    points = [meter.end(None, "wrap")]
    x, y = batch
    for i in range(MEMORY_STEPS):
        meter.begin()
        with bench_fsdp.autocast(name, device, precision):
            loss = model(x, y)
        points.append(meter.end(i, "forward"))
        meter.begin()
        loss.backward()
        points.append(meter.end(i, "backward"))
        meter.begin()
        opt.step()
        points.append(meter.end(i, "step"))
        meter.begin()
        opt.zero_grad(set_to_none=True)
        del loss
        points.append(meter.end(i, "zero_grad"))
    del model, opt
    return {"points": points, "peak": max(p["peak"] for p in points)}


def bench_rank(config: str, precision: str, names: list[str], batch_size: int, warmup: int, steps: int,
               device_kind: str) -> dict:
    """One rank of one (config, precision): the memory pass (each trainer alone), then the time pass (in turns)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    device = rank_device(device_kind)
    say = harness.say_on_rank0(f"{config} {precision} N={world}")
    cfg, corpus = CONFIGS[config](), CharCorpus()
    tiny = GPTConfig.tiny()
    tiny_batch = [t.to(device) for t in corpus.batch(0, 2, tiny.block_size, rank, world)]
    for name in names:  # kernels, handles and workspaces made once, before anything is measured
        model, opt = bench_fsdp.build(name, TinyGPT(tiny, seed=0), device, precision)
        bench_fsdp.step(name, model, opt, *tiny_batch, device, precision)
        del model, opt
    base = TinyGPT(cfg, seed=0)  # on the CPU; each trainer gets a copy moved to the device
    batches = [[t.to(device) for t in corpus.batch(i, batch_size, cfg.block_size, rank, world)]
               for i in range(min(4, warmup + steps))]
    memory = {}
    for name in names:
        memory[name] = memory_alone(name, base, batches[0], device, precision)
        say(f"memory: {name} alone, peak {memory[name]['peak'] / 2**20:.0f} MB over its baseline")
    gc.collect()
    timings = bench_fsdp.time_trainers(names, base, batches, warmup, steps, device, precision, say)
    return {"times": timings.wall, "memory": memory,
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}


def summarize(world: int, config: str, precision: str, results: list[dict], names: list[str]) -> list[dict]:
    """One row per trainer: median step time, peak (max over ranks), ratios to torch FSDP1 and FSDP2."""
    rows = []
    for name in names:
        peaks = [r["memory"][name]["peak"] for r in results]
        times = results[0]["times"][name]  # already the max over ranks
        rows.append({"config": config, "precision": precision, "world_size": world, "trainer": name,
                     "step_s": statistics.median(times), "step_times_s": times, "peak_bytes": max(peaks),
                     "peak_bytes_per_rank": peaks, "memory_rank0": results[0]["memory"][name]["points"]})
    return bench_fsdp.ratios_to_torch(rows, ("step_s", "peak_bytes"))


def format_table(rows: list[dict]) -> str:
    """Per trainer: step time and peak, each with its ratios; then each phase's peak (MB over the baseline)."""
    def phases(r: dict) -> str:
        pts = r["memory_rank0"]
        return f"  {pts[0]['peak'] / 2**20:.0f} | " + " | ".join(
            " ".join(f"{p['peak'] / 2**20:.0f}" for p in pts if p["step"] == s) for s in range(MEMORY_STEPS))

    return harness.table(rows, [
        ("N", "world_size", ">2"), ("trainer", "trainer", "<11"), ("step ms", harness.scaled("step_s", 1e3), ">9.1f"),
        ("spread", lambda r: harness.spread(r["step_times_s"]), ">6.0%"), ("x FSDP1", "time_ratio", ">8.3f"),
        ("x FSDP2", "time_ratio_fsdp2", ">8.3f"), ("peak MB", harness.scaled("peak_bytes", 2**-20), ">9.1f"),
        ("x FSDP1", "peak_ratio", ">8.3f"), ("x FSDP2", "peak_ratio_fsdp2", ">8.3f"),
        ("  phase peaks, MB (wrap | step 1: fwd bwd opt zero | step 2: ...)", phases, "<")])


def format_summary(rows: list[dict], names: list[str]) -> str:
    """One line per (config, precision, N): each trainer's step time as a ratio to torch FSDP1 (FSDP1's own in ms),
    then the two pairs the book reads: ours FSDP / torch FSDP1 and ours fully_shard / torch FSDP2, time and peak."""
    runs = {}
    for r in (r for r in rows if "trainer" in r):
        runs.setdefault((r["config"], r["precision"], r["world_size"]), {})[r["trainer"]] = r
    pairs = {"ours/FSDP1": ("ours_torch", ""), "ours_fsdp2/FSDP2": ("ours_fsdp2", "_fsdp2")}
    lines = []
    for (config, precision, n), mine in runs.items():
        line = {"config": config, "prec": precision, "N": n}
        line.update({t: f"{r['step_s'] * 1e3:.1f} ms" if t == bench_fsdp.REFERENCE else r["time_ratio"]
                     for t, r in mine.items() if r["time_ratio"] is not None})
        for pair, (trainer, suffix) in pairs.items():
            for what in ("time", "peak"):
                line[f"{pair} {what}"] = mine.get(trainer, {}).get(f"{what}_ratio{suffix}")
        lines.append(line)
    columns = [("config", "config", "<6"), ("prec", "prec", "<5"), ("N", "N", ">2")]
    columns += [(t, lambda r, t=t: f"{r[t]:.3f}" if isinstance(r.get(t), float) else r.get(t), ">10") for t in names]
    columns += [(h, h, f">{len(h)}.3f") for h in (f"{p} {w}" for p in pairs for w in ("time", "peak"))]
    failed = [f"{r['config']} {r['precision']} N={r['world_size']}: FAILED ({r['error'].strip().splitlines()[-1]})"
              for r in rows if "error" in r]
    return "\n".join(["step time x torch FSDP1 (FSDP1's own in ms), and the two pairs:",
                      harness.table(lines, columns), *failed])


def run_fsdp_bench_cuda(args) -> int:
    """Entry point (cli.py, ``bench fsdp --device cuda``): every (config, precision) at every world size."""
    configs = harness.choose(args.config or "85m", CONFIGS, "--config")
    precisions = harness.choose(args.precision or "fp32", PRECISIONS, "--precision")
    names = harness.choose(args.trainers or ",".join(TRAINERS), TRAINERS,
                           "--trainers (ours_ring is for gloo: not on cuda)")
    sizes = harness.world_sizes(args.world_sizes or "1", smallest=1)
    for name in ("steps", "warmup", "batch_size"):
        value = getattr(args, name, None)
        if value is not None and value < (0 if name == "warmup" else 1):
            raise SystemExit("--steps and --batch-size must be >= 1 and --warmup >= 0")
    placement = resolve_device("cuda", max(sizes))
    json_path = "out/bench_fsdp_cuda.json" if args.json is None else args.json
    run = harness.BenchRun(f"minifsdp bench fsdp --device cuda: {placement.describe()}; configs "
                           f"{', '.join(configs)}; precision {', '.join(precisions)}; world sizes "
                           f"{', '.join(map(str, sizes))}; trainers {', '.join(names)}; torch {torch.__version__}, "
                           f"CUDA {torch.version.cuda}")
    rows, failed = [], False
    for config in configs:
        cfg = CONFIGS[config]()
        plan = {k: getattr(args, k, None) if getattr(args, k, None) is not None else v
                for k, v in DEFAULTS.get(config, OTHER_DEFAULTS).items()}
        with torch.device("meta"):  # shapes only: a 300M model's init on the CPU takes seconds
            n_params = sum(p.numel() for p in TinyGPT(cfg, seed=0).parameters())
        for precision in precisions:
            for n in sizes:
                print(f"{config} ({n_params / 1e6:.1f}M parameters, {cfg.n_layer} x {cfg.n_embd}, T={cfg.block_size}, "
                      f"batch {plan['batch_size']} per rank), {precision}, world size {n}: {plan['warmup']} warm-up + "
                      f"{plan['steps']} timed steps per trainer ...", flush=True)
                t0 = time.perf_counter()
                try:
                    results = harness.run_ranks(
                        bench_rank, (config, precision, names, plan["batch_size"], plan["warmup"], plan["steps"],
                                     "cuda"), n, threads=None, timeout_s=1200, backend=placement.backend)
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
                    harness.save_rows(json_path, rows, device=placement.describe(), cuda=torch.version.cuda,
                                      world_sizes=sizes, trainers=names, reference=bench_fsdp.REFERENCE,
                                      reference_fsdp2=bench_fsdp.REFERENCE_FSDP2)
    print(format_summary(rows, names))
    run.close("ratios to torch FSDP1 / FSDP2 in the same spawn: below 1 is faster / smaller; peak = the largest "
              "phase peak of memory_allocated over the trainer's baseline, each alone")
    if json_path:
        print(f"wrote {json_path}")
    return 1 if failed else 0
