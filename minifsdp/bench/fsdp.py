"""``python -m minifsdp bench fsdp``: our FSDP against torch's FSDP1, FSDP2 and DDP, in the same run.

Six trainers of the same TinyGPT (``GPTConfig.bench()``: 19.0M parameters, each
``Block`` its own unit, AdamW), built side by side in every rank of one spawn:

    ours_torch   minifsdp FSDP, FULL_SHARD, torch.distributed's collectives
    ours_ring    minifsdp FSDP, FULL_SHARD, our ring collectives (minifsdp.comm.collectives)
    fsdp1        torch FullyShardedDataParallel, FULL_SHARD          <- the reference (ratio 1.00)
    fsdp2        torch fully_shard (reshard_after_forward=True)
    ours_fsdp2   minifsdp.fully_shard (per-parameter, chapter 5), as fsdp2  <- also read against fsdp2
    ddp          torch DistributedDataParallel (gradient_as_bucket_view=True)

Step time.  One round of the bench harness (:mod:`minifsdp.bench.harness`:
turns, each time the slowest rank's, ``--warmup`` rounds first) is one step of each
trainer (zero_grad, forward, backward, optimizer.step); we keep the median of
``--steps`` rounds, and of the step's CPU time (``time.process_time``, every thread
of the rank): on a machine shared with other work it is steadier than the clock.

Peak memory, three witnesses.  In a second spawn (fresh ranks, told to give
freed memory back to the OS: ``MALLOC_ENV``), each trainer is built in turn
*alone* (the one before dropped), takes one warm-up step, then two steps under
:class:`minifsdp.memory.MemoryTracker` (not timed: the tracker slows every op).
The first finds the peak; in the second, at each new peak within 1% of it (a
census costs ~0.1 s, a step makes 30-50 new peaks), a witness reads, at that
same moment,

    census   live_tensor_bytes(): every live tensor storage, found by a scan of
             Python's objects (minifsdp.memory.census; no dispatch mode)
    RSS      the process's resident set size (/proc/self/statm)

and each of the three is printed as its rise over the moment before the trainer
was built (after gc.collect() and malloc_trim):

    peak MB    tracker's peak - census before     (the trainer's own tensors)
    census MB  census at the peak - census before (equal, but for a few bytes: the
               8-byte tensor autograd saves for each Python number in x / 4.0,
               which no op and no hook shows the tracker)
    RSS+ MB    RSS at the peak - RSS before       (sees everything, not whose: gloo's
               buffers, malloc's overhead, Python objects; but only pages already
               written, not a receive buffer still filling.  At 19M parameters
               within a few % of the others)

Subtracting the census before a trainer also removes what earlier trainers
left behind: torch FSDP1 (and ours) keep a dropped model's shards alive through
a reference cycle the garbage collector cannot see into.

What the peak is made of.  Under the table, one line per trainer splits its
peak (the rank with the top one) by the tracker's categories (``minifsdp.memory.
tracker.CATEGORIES``): the shards, Adam's state, the gathered (unsharded)
parameters, the activations saved for backward, "other" (gradients being
computed, comm buffers), and "made" = resident at the peak - census before:
what the trainer made before the tracked step and still holds, not reachable
from the model or optimizer: our ring's buffers kept between collectives
(scratch, header receives posted ahead), counted apart as "ring ws".  A second
line per trainer names the categories where it differs from FSDP1 at their peaks.

Every figure is printed as a ratio to torch FSDP1, measured in the same run
(times in the same processes and minutes): the only kind of performance claim
the book makes.  Step time and peak are also printed as ratios to torch FSDP2
(``x FSDP2``), the pair to read for ``ours_fsdp2``.

The trainers (:func:`wrap`) and their time pass (:func:`time_trainers`: one round is one
:func:`step` of each on the round's batch) are the GPU bench's too (``fsdp_cuda.py``).

Note: on a laptop the ranks share a few cores (4 ranks on 2 cores run at half
speed each) and every link is the loopback interface; compute dominates, so
the ratios are what to read, not the milliseconds.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import functools
import gc
import itertools
import statistics
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.distributed.algorithms._checkpoint.checkpoint_wrapper as torch_checkpointing
import torch.distributed.fsdp as torch_fsdp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy as torch_auto_wrap_policy

import minifsdp.fsdp as ours
import minifsdp.fsdp2 as ours2
from minifsdp.bench import harness
from minifsdp.comm import stream as comm_stream
from minifsdp.memory.census import live_tensor_bytes, return_freed_memory, rss_bytes
from minifsdp.memory.tracker import CATEGORIES, MemoryTracker, snapshot
from minifsdp.models import Block, CharCorpus, GPTConfig, TinyGPT

__all__ = ["run_fsdp_bench", "TRAINERS", "CONFIGS", "bench_rank", "format_table", "FSDP1", "fsdp1", "wrap", "build",
           "step", "time_trainers"]

TRAINERS = ("ours_torch", "ours_ring", "fsdp1", "fsdp2", "ours_fsdp2", "ddp")
REFERENCE = "fsdp1"
REFERENCE_FSDP2 = "fsdp2"  # the second reference: per-parameter sharding, ours against torch's
CONFIGS = {"bench": GPTConfig.bench, "small": GPTConfig.small, "tiny": GPTConfig.tiny}
# the aims: step time <= 0.9x torch FSDP1's on the small config and ahead of it (< 1x) on the others;
# peak per rank <= min(FSDP1's, FSDP2's) on every config (each where measured)
AIMS = {"ours_torch": 0.9, "ours_ring": 0.9}  # the small config's; elsewhere 1.0 (_aim)
SHORT = {"parameters": "shards", "gradients": "grads", "optimizer_state": "adam", "buffers": "buffers",
         "unsharded_parameters": "gathered", "activations": "activations", "other": "other"}
# glibc: every block of 64 KiB or more gets its own mapping, unmapped when freed.  By default glibc raises this
# threshold (up to 32 MiB) each time such a block is freed, then keeps freed blocks for reuse, so the RSS holds
# what was freed and reads up to 2x the live tensors (19M parameters).  Only in the memory spawn: it slows steps.
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(64 << 10)}
CPU = harness.CPU


# FSDP1, torch's and ours: the same names, the same calls (minifsdp.fsdp mirrors torch.distributed.fsdp)
FSDP1 = {side: SimpleNamespace(FSDP=api.FullyShardedDataParallel, BackwardPrefetch=api.BackwardPrefetch,
                               MixedPrecision=api.MixedPrecision, policy=policy, checkpointing=checkpointing)
         for side, api, policy, checkpointing in (
             ("torch", torch_fsdp, torch_auto_wrap_policy, torch_checkpointing.apply_activation_checkpointing),
             ("ours", ours, ours.transformer_auto_wrap_policy, ours.apply_activation_checkpointing))}


def fsdp1(side: str, model: torch.nn.Module, **kwargs) -> torch.nn.Module:
    """``model`` under FSDP1, ``side`` "torch" or "ours", each Block its own unit; ``kwargs`` to the constructor."""
    api = FSDP1[side]
    return api.FSDP(model, auto_wrap_policy=functools.partial(api.policy, transformer_layer_cls={Block}), **kwargs)


def wrap(name: str, model: torch.nn.Module, device: torch.device = CPU, precision: str = "fp32") -> torch.nn.Module:
    """``model`` (a TinyGPT on ``device``) as trainer ``name``; every FSDP wraps each Block as its own unit.

    ``precision`` "bf16": MixedPrecision(param_dtype=bf16, reduce_dtype=fp32) for both FSDP1s, the same
    MixedPrecisionPolicy for both fully_shards; ``plain`` and ``ddp`` take ``torch.autocast`` in :func:`step`.
    """
    bf16 = dict(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if precision == "bf16" else None
    if name == "plain":  # the unwrapped model: no communication, the floor
        return model
    if name == "ddp":
        return torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None, gradient_as_bucket_view=True)
    if name in ("ours_torch", "ours_ring", "fsdp1"):
        side = "torch" if name == "fsdp1" else "ours"
        kw = {"device_id": device} if side == "torch" else {"collectives": name[len("ours_"):]}
        return fsdp1(side, model, mixed_precision=FSDP1[side].MixedPrecision(**bf16) if bf16 else None, **kw)
    if name in ("fsdp2", "ours_fsdp2"):  # the same calls: every Block, then the root, on a 1-D mesh
        api = torch_fsdp if name == "fsdp2" else ours2  # the same names: fully_shard, MixedPrecisionPolicy
        kw = {"mesh": init_device_mesh(device.type, (dist.get_world_size(),))}
        if bf16:
            kw["mp_policy"] = api.MixedPrecisionPolicy(**bf16)
        for block in model.blocks:
            api.fully_shard(block, **kw)
        return api.fully_shard(model, **kw)
    raise ValueError(f"unknown trainer {name!r}; choose from {', '.join(TRAINERS)} or plain")


def build(name: str, model: torch.nn.Module, device: torch.device = CPU, precision: str = "fp32"):
    """(``model`` moved to ``device`` and wrapped as trainer ``name``, its AdamW with lr 1e-4)."""
    model = wrap(name, model.to(device), device, precision)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def autocast(name: str, device: torch.device, precision: str):
    """bf16 for the trainers without a mixed-precision setting of their own (plain, ddp): torch.autocast."""
    if precision == "bf16" and name in ("plain", "ddp"):
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def step(name: str, model, opt, x, y, device: torch.device = CPU, precision: str = "fp32") -> None:
    """One training step: zero_grad, forward (under :func:`autocast`), backward, the optimizer's step."""
    opt.zero_grad(set_to_none=True)
    with autocast(name, device, precision):
        loss = model(x, y)
    loss.backward()
    opt.step()


def time_trainers(names: list[str], model: torch.nn.Module, batches: list, warmup: int, steps: int,
                  device: torch.device = CPU, precision: str = "fp32", say=None) -> harness.Timings:
    """Every trainer built side by side (each from a copy of ``model``), then timed in turns (the bench harness):
    one round is one :func:`step` of each, on the round's batch (``batches[i % len(batches)]``: the same data)."""
    def one_step(name, model, opt):
        feed = itertools.cycle(batches)
        return lambda: step(name, model, opt, *next(feed), device, precision)

    trainers = {name: build(name, copy.deepcopy(model), device, precision) for name in names}
    if say is not None:
        say(f"built {', '.join(names)}; warm-up ({warmup} step(s) each) ...")
    return harness.interleave({name: one_step(name, *trainers[name]) for name in names}, steps, warmup, device, say)


def bench_rank(config: str, names: list[str], batch_size: int, warmup: int, steps: int) -> dict:
    """One rank: build every trainer, time them in turns (the bench harness)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg, corpus = CONFIGS[config](), CharCorpus()
    batches = [corpus.batch(i, batch_size, cfg.block_size, rank, world) for i in range(warmup + steps)]
    timings = time_trainers(names, TinyGPT(cfg, seed=0), batches, warmup, steps, say=harness.say_on_rank0(f"N={world}"))
    return {"times": timings.wall, "cpu": timings.cpu}


def memory_rank(config: str, names: list[str], batch_size: int) -> dict:
    """One rank of the memory spawn: each trainer alone, its peak seen by the tracker, the census and the RSS."""
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg, tiny, corpus = CONFIGS[config](), GPTConfig.tiny(), CharCorpus()
    # First, one step of every trainer on the tiny GPT, one of them tracked: the first use of a kernel pages
    # its code in from libtorch, tens of MB of RSS that would otherwise land on the first trainer measured.
    for i, name in enumerate(names):
        model, opt = build(name, TinyGPT(tiny, seed=0))
        with MemoryTracker(model, opt) if i == 0 else contextlib.nullcontext():
            step(name, model, opt, *corpus.batch(0, 1, tiny.block_size, rank, world))
        del model, opt
    batch = corpus.batch(0, batch_size, cfg.block_size, rank, world)
    return {name: _memory_alone(name, cfg, batch) for name in names}


def _ring_workspace_bytes() -> int:
    """Bytes our comm streams keep between collectives (``minifsdp.comm``: the scratch workspace, the header
    receives posted ahead), each storage once; 0 if there are none."""
    found, todo = {}, [(getattr(s, "workspace", None), getattr(s, "doorbells", None))
                       for s in list(getattr(comm_stream, "_STREAMS", {}).values())]
    while todo:
        x = todo.pop()
        if isinstance(x, torch.Tensor):
            found[x.untyped_storage().data_ptr()] = x.untyped_storage().nbytes()
        elif isinstance(x, dict):
            todo.extend(x.values())
        elif isinstance(x, (list, tuple, collections.deque)):
            todo.extend(x)
    return sum(found.values())


def _memory_alone(name: str, cfg: GPTConfig, batch) -> dict:
    """Build ``name`` with nothing else alive, warm it up, track one step; tracker, census and RSS at its peak."""
    gc.collect()
    return_freed_memory()
    census_before, rss_before, ws_before = live_tensor_bytes(), rss_bytes(), _ring_workspace_bytes()
    model, opt = build(name, TinyGPT(cfg, seed=0))
    step(name, model, opt, *batch)  # lazy init, Adam's state
    rest = snapshot(model, opt)
    with MemoryTracker(model, opt) as probe:  # where the peak is (the steps allocate alike from here on)
        step(name, model, opt, *batch)
    mt = MemoryTracker(model, opt)

    def witness():  # RSS first: the census's list of every Python object would otherwise sit in it
        if mt.current_bytes < 0.99 * probe.peak_bytes:
            return None
        return rss_bytes(), live_tensor_bytes(collect=False)

    mt.on_peak = witness
    with mt:
        step(name, model, opt, *batch)
    rss_at_peak, census_at_peak = mt.on_peak_result or (None, None)  # None: this step's peak fell short
    rise = lambda after, before: after - before if after is not None else None  # noqa: E731
    # The ring's buffers are made by the first ring collective of the process (the warm-up above) and kept
    # for good: they belong to a ring trainer even though they were there before it was built.  Left in the
    # "before" they would hide the header receives posted ahead (about 3 MB at 2 ranks) from its peak.
    kept = ws_before if name == "ours_ring" else 0
    before = census_before - kept
    return {"peak_bytes": mt.peak_bytes - before, "census_bytes": rise(census_at_peak, before),
            "rss_bytes": rise(rss_at_peak, rss_before), "tracker_peak_total": mt.peak_bytes,
            "census_at_peak_total": census_at_peak, "census_before": before,
            "model_state_bytes": rest["parameters"] + rest["gradients"] + rest["optimizer_state"],
            "at_peak": mt.breakdown_at_peak, "ring_workspace_bytes": _ring_workspace_bytes() - ws_before + kept}


def summarize(world: int, results: list[dict], names: list[str]) -> list[dict]:
    """One row per trainer: median step time, peak bytes (max over ranks), both as ratios to FSDP1."""
    times = results[0]["times"]  # already the max over ranks, step by step
    rows = []
    for name in names:
        peaks = [r["memory"][name]["peak_bytes"] for r in results]
        top = results[peaks.index(max(peaks))]["memory"][name]  # census and RSS from the rank with the top peak
        rows.append({"world_size": world, "trainer": name, "step_s": statistics.median(times[name]),
                     "step_times_s": times[name], "cpu_s": statistics.median(results[0]["cpu"][name]),
                     "cpu_times_s": results[0]["cpu"][name], "peak_bytes": max(peaks), "peak_bytes_per_rank": peaks,
                     "census_bytes": top["census_bytes"], "rss_bytes": top["rss_bytes"],
                     "census_bytes_per_rank": [r["memory"][name]["census_bytes"] for r in results],
                     "rss_bytes_per_rank": [r["memory"][name]["rss_bytes"] for r in results],
                     "model_state_bytes": max(r["memory"][name]["model_state_bytes"] for r in results),
                     "at_peak_rank0": results[0]["memory"][name]["at_peak"],
                     "peak_breakdown": peak_breakdown(top)})
    ratios_to_torch(rows, ("step_s", "cpu_s", "peak_bytes"))
    best = min((r["peak_bytes"] for r in rows if r["trainer"] in (REFERENCE, REFERENCE_FSDP2)), default=None)
    for r in rows:
        r["peak_ratio_best_torch"] = harness.ratio(r["peak_bytes"], best)
    return rows


def ratios_to_torch(rows: list[dict], keys: tuple[str, ...], same: tuple[str, ...] = ("world_size",)) -> list[dict]:
    """Each of ``keys`` as a ratio to torch FSDP1's in the same run (``time_ratio``, ``cpu_ratio``,
    ``peak_ratio``), then step time and peak to torch FSDP2's (``time_ratio_fsdp2``, ``peak_ratio_fsdp2``)."""
    out = {"step_s": "time_ratio", "cpu_s": "cpu_ratio", "peak_bytes": "peak_ratio"}
    for key, reference, suffix in [(k, REFERENCE, "") for k in keys] + [(k, REFERENCE_FSDP2, "_fsdp2")
                                                                       for k in ("step_s", "peak_bytes")]:
        harness.add_ratios(rows, key, out[key] + suffix, reference, same=same)
    return rows


def peak_breakdown(memory: dict) -> dict[str, int]:
    """The peak bytes (over the census before the trainer was built) by the tracker's category.

    "made": resident at the peak less the census before: bytes the trainer made before the
    tracked step and still holds outside the model and optimizer; "ring_ws" (part of it): the
    comm streams' scratch.  The values other than "ring_ws" add up to ``peak_bytes``.
    """
    at = memory["at_peak"]
    out = {c: at.get(c, 0) for c in CATEGORIES if c != "resident"}
    out["made"] = at.get("resident", 0) - (memory["tracker_peak_total"] - memory["peak_bytes"])
    out["ring_ws"] = memory.get("ring_workspace_bytes", 0)
    return out


def format_breakdowns(rows: list[dict]) -> str:
    """Per trainer: its peak by category (MB); then the same less torch FSDP1's at its peak (KiB, same world size)."""
    ref = {r["world_size"]: r["peak_breakdown"] for r in rows if r["trainer"] == REFERENCE}
    names = [("N", "world_size", ">2"), ("trainer", "trainer", "<11")]
    heads = {**SHORT, "made": "made", "ring_ws": "ring ws"}
    mib = [(h, lambda r, c=c: r["peak_breakdown"][c] / 2**20, f">{max(len(h), 6)}.2f") for c, h in heads.items()]
    kib = [(h, lambda r, c=c: (r["peak_breakdown"][c] - ref[r["world_size"]][c]) / 2**10 if r["world_size"] in ref
            else None, f">+{max(len(h), 6)}.1f") for c, h in heads.items()]
    return "\n".join(["peak by category, MB ('made': held outside the model and optimizer since before the step; "
                      "'ring ws', part of it: the ring's buffers kept between collectives):",
                      harness.table(rows, names + mib), "the same less torch FSDP1's, KiB:",
                      harness.table(rows, names + kib)])


def _aim(r: dict, config: str) -> str:
    """The step-time ratio to torch FSDP1 the trainer aims at (at most AIMS' on the small config, strictly
    below 1, i.e. ahead of torch, elsewhere), and the peak at most torch's best; met or missed."""
    if r["trainer"] not in AIMS or r["time_ratio"] is None:
        return ""
    goal = AIMS[r["trainer"]] if config == "small" else 1.0
    ok_t = r["time_ratio"] <= goal if goal < 1 else r["time_ratio"] < goal
    return (f" time {'<=' if goal < 1 else '<'} {goal}x: {'ok' if ok_t else 'MISSED'}; "
            f"peak <= torch's best: {'ok' if r['peak_ratio_best_torch'] <= 1 else 'MISSED'}")


def format_table(rows: list[dict], config: str = "small") -> str:
    """Per trainer: step time (median; spread = (max - min) / median of the rounds), CPU time, peak and its
    witnesses, each with its ratios to torch FSDP1 and FSDP2; the aim where the trainer has one."""
    ms, mib = (lambda key: harness.scaled(key, 1e3)), (lambda key: harness.scaled(key, 2**-20))
    return harness.table(rows, [
        ("N", "world_size", ">2"), ("trainer", "trainer", "<11"), ("step ms", ms("step_s"), ">9.1f"),
        ("spread", lambda r: harness.spread(r["step_times_s"]), ">6.0%"), ("x FSDP1", "time_ratio", ">8.3f"),
        ("x FSDP2", "time_ratio_fsdp2", ">8.3f"), ("cpu ms", ms("cpu_s"), ">9.1f"), ("x FSDP1", "cpu_ratio", ">8.3f"),
        ("peak MB", mib("peak_bytes"), ">9.2f"), ("x FSDP1", "peak_ratio", ">8.3f"),
        ("x FSDP2", "peak_ratio_fsdp2", ">8.3f"), ("census MB", mib("census_bytes"), ">9.2f"),
        ("RSS+ MB", mib("rss_bytes"), ">8.2f"), ("state MB", mib("model_state_bytes"), ">9.2f"),
        ("aim", lambda r: _aim(r, config), "")])


def run_fsdp_bench(args) -> int:
    """Entry point (args: world_sizes, steps, warmup, batch_size, config, trainers, json)."""
    sizes = harness.world_sizes(args.world_sizes)
    if args.steps < 1 or args.warmup < 0 or args.batch_size < 1:
        raise SystemExit("--steps and --batch-size must be >= 1 and --warmup >= 0")
    names = harness.choose(args.trainers, TRAINERS, "--trainers")
    if args.config not in CONFIGS:
        raise SystemExit(f"--config must be one of {sorted(CONFIGS)}, got {args.config!r}")
    cfg = CONFIGS[args.config]()
    n_params = sum(p.numel() for p in TinyGPT(cfg, seed=0).parameters())
    run = harness.BenchRun(f"minifsdp bench fsdp: TinyGPT {args.config} ({n_params / 1e6:.2f}M parameters, "
                           f"{cfg.n_layer} blocks, each its own unit), AdamW, batch {args.batch_size} x "
                           f"{cfg.block_size} tokens per rank, {args.warmup} warm-up + {args.steps} timed steps; "
                           f"trainers {', '.join(names)}")
    rows = []
    for n in sizes:
        print(f"world size {n}: one spawn, {len(names)} trainers; then one more for memory, each alone ...",
              flush=True)
        results = harness.run_ranks(bench_rank, (args.config, names, args.batch_size, args.warmup, args.steps), n)
        memory = harness.run_ranks(memory_rank, (args.config, names, args.batch_size), n, env=MALLOC_ENV)
        rows += summarize(n, [{**r, "memory": m} for r, m in zip(results, memory)], names)
    print(format_table(rows, args.config))
    print(format_breakdowns(rows))
    run.close("ratios are to torch FSDP1 (and FSDP2) in the same run: below 1 is faster / smaller")
    print("(peak: MemoryTracker; census: live tensors counted at the same moment; RSS+: the process's resident "
          "memory growth to that moment; all three over the moment before the trainer was built, each alone)")
    if args.json:
        harness.save_rows(args.json, rows, threads_per_rank=1, config=args.config, n_params=n_params,
                          batch_size=args.batch_size, block_size=cfg.block_size, warmup=args.warmup,
                          steps=args.steps, reference=REFERENCE)
        print(f"wrote {args.json}")
    return 0
