"""``python -m minifsdp bench scale``: the largest TinyGPT that trains under a per-rank memory limit.

The one thing FSDP exists for: a model that does not fit on one rank trains when
sharded.  For each trainer and world size N, every *trial* is one spawn of N ranks
that, under a hard per-rank limit, builds a TinyGPT of ``n_layer`` blocks (fixed
width) and takes one AdamW step:

    ddp     torch DistributedDataParallel: the full model on every rank (built whole)
    ours    minifsdp FSDP, FULL_SHARD, each Block a unit, built on the meta device
            (param_init_fn = deferred_init.tinygpt_param_init_fn)
    fsdp1   torch FullyShardedDataParallel, the same meta model and param_init_fn

The limit.  Each rank sets ``RLIMIT_AS`` (its address space) to what it has mapped
after start-up (torch, gloo, Python) plus ``--mem-limit-mb``: an allocation past it
fails inside the allocator ("can't allocate memory"), the rank raises, the trial is
reported as OUT OF MEMORY.  Address space counts reserved-but-untouched pages and what
malloc keeps after a free, so each rank first tells glibc to unmap freed blocks of 64 KiB
or more and to use two arenas at most (``mallopt``); without that a sharded model's freed
unit copies stay mapped and FSDP measures no better than DDP.

The search.  Parameters grow linearly with ``n_layer``, so a bisection on the depth is
a bisection on the parameter count: double the depth until a trial fails, then bisect
between the last success and the first failure (a tqdm bar counts the trials).

The prediction (ZeRO, fp32 AdamW: 4 param + 4 grad + 8 Adam = 16 bytes per parameter,
Rajbhandari et al. 2019): DDP holds 16Ψ; FULL_SHARD 16Ψ/N plus one unit's full
parameters and gradients (8U) during its turn; both plus activations and runtime
overhead A, taken as the smallest trial's measured peak less its model state.

Output: the table, and ``out/bench_scale.json`` with one row per (trainer, N):
``{"trainer", "world_size", "mem_limit_bytes", "largest_params", "peak_bytes", ...}``.
``peak_bytes`` is the largest passing trial's peak RSS rise over the rank's start
(max over ranks; it can pass the limit: pages mapped before the limit was set, such as
libraries, count in the RSS when first touched, not in the new address space).

Measured (2-core laptop-class machine, 4 ranks, 256 MiB per rank, width 256, 16 min):

    trainer  blocks  largest params  ZeRO predicts  x DDP
    ddp          18      14,257,152     12,968,192   1.00
    ours         70      55,324,672     50,834,176   3.88
    fsdp1        70      55,324,672     50,789,120   3.88     (ours / torch FSDP1: 1.00)
"""

from __future__ import annotations

import ctypes
import ctypes.util
import resource
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from minifsdp.bench import harness
from minifsdp.bench.fsdp import fsdp1
from minifsdp.fsdp.deferred_init import tinygpt_param_init_fn
from minifsdp.launch import RankFailedError
from minifsdp.models import Block, GPTConfig, TinyGPT

__all__ = ["run_scale_bench", "trial", "params_of", "largest"]

OOM = "OUT_OF_MEMORY"
_OOM_SIGNS = (OOM, "can't allocate memory", "bad_alloc", "MemoryError", "Cannot allocate memory",
              "failed to map segment", "can't start new thread")


def _status() -> dict[str, int]:
    with open("/proc/self/status") as f:
        fields = dict(line.split(":", 1) for line in f if ":" in line)
    return {k: int(fields[k].split()[0]) * 1024 for k in ("VmSize", "VmRSS", "VmHWM")}


def config(n_layer: int, width: int, seq: int = 64) -> GPTConfig:
    return GPTConfig(vocab_size=96, block_size=seq, n_layer=n_layer, n_head=max(1, width // 64), n_embd=width)


def params_of(n_layer: int, width: int) -> int:
    """TinyGPT's parameter count (the tied lm_head once), without building it."""
    cfg = config(n_layer, width)
    with torch.device("meta"):
        block = sum(p.numel() for p in Block(cfg).parameters())
    return n_layer * block + (cfg.vocab_size + cfg.block_size) * width + 2 * width


def _build(trainer: str, cfg: GPTConfig):
    if trainer == "ddp":
        return DDP(TinyGPT(cfg, seed=0), gradient_as_bucket_view=True)
    with torch.device("meta"):
        model = TinyGPT(cfg, seed=0)
    return fsdp1("ours" if trainer == "ours" else "torch", model, param_init_fn=tinygpt_param_init_fn(model, seed=0),
                 device_id=torch.device("cpu"))


def _malloc_returns_freed_memory() -> None:
    """glibc: blocks of 64 KiB or more are unmapped when freed (by default it raises that threshold up to
    32 MiB as such blocks are freed and keeps them: a sharded model's freed unit copies would stay mapped and
    count against the limit), two arenas at most, and what is free now is given back."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt(-3, 64 << 10)  # M_MMAP_THRESHOLD
        libc.mallopt(-8, 2)  # M_ARENA_MAX
        libc.malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: the limit then also counts what malloc keeps
        pass


def trial(trainer: str, n_layer: int, width: int, mem_limit: int, batch: int = 1, seq: int = 64) -> dict:
    """On each rank: limit the address space, build, one AdamW step; the peak RSS rise (bytes).

    The limit is lifted again before the result (or the error) is reported: sending it
    needs a thread, and a thread needs address space.
    """
    _malloc_returns_freed_memory()
    start = _status()
    resource.setrlimit(resource.RLIMIT_AS, (start["VmSize"] + mem_limit, resource.RLIM_INFINITY))
    try:
        model = _build(trainer, config(n_layer, width, seq))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        g = torch.Generator().manual_seed(dist.get_rank())
        x, y = (torch.randint(0, 96, (batch, seq), generator=g) for _ in range(2))
        model(x, y).backward()
        opt.step()
    except BaseException as e:  # noqa: BLE001 - out of memory becomes one recognisable error, the rest re-raised
        resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
        if any(s in str(e) or s in type(e).__name__ for s in _OOM_SIGNS):
            raise RuntimeError(f"{OOM}: {trainer}, {n_layer} blocks, limit {mem_limit >> 20} MiB: {e}") from None
        raise
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    return {"peak_bytes": max(0, _status()["VmHWM"] - start["VmRSS"])}


def _fits(trainer, n_layer, width, mem_limit, world_size, timeout_s) -> tuple[bool, int]:
    try:
        out = harness.run_ranks(trial, (trainer, n_layer, width, mem_limit), world_size, timeout_s=timeout_s)
    except RankFailedError as e:
        if any(s in str(e) for s in _OOM_SIGNS) or "signal" in str(e):
            return False, 0
        raise
    return True, max(r["peak_bytes"] for r in out)


def largest(trainer: str, world_size: int, width: int, mem_limit: int, max_layers: int = 512,
            timeout_s: float = 600, bar=None) -> dict:
    """Double the depth until a trial fails, then bisect; the largest depth that trains, and its peak."""
    tried: dict[int, tuple[bool, int]] = {}

    def fits(n):
        if n not in tried:
            tried[n] = _fits(trainer, n, width, mem_limit, world_size, timeout_s)
            if bar is not None:
                bar.update(1)
                bar.set_postfix_str(f"{trainer} N={world_size} {n} blocks: {'ok' if tried[n][0] else 'OOM'}")
        return tried[n][0]

    lo, hi = 0, 1
    while hi <= max_layers and fits(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, max_layers + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    smallest_ok = min((n for n, (ok, _) in tried.items() if ok), default=None)
    return {"trainer": trainer, "world_size": world_size, "mem_limit_bytes": mem_limit, "width": width,
            "largest_layers": lo, "largest_params": params_of(lo, width) if lo else 0,
            "peak_bytes": tried[lo][1] if lo else None, "trials": len(tried),
            "smallest": (smallest_ok, tried[smallest_ok][1]) if smallest_ok else None}


def predicted_params(row: dict) -> int | None:
    """Ψ from the ZeRO formulas, with the overhead A measured at the smallest passing trial."""
    if not row["smallest"]:
        return None
    n_small, peak_small = row["smallest"]
    width, n = row["width"], (1 if row["trainer"] == "ddp" else row["world_size"])
    unit = params_of(1, width) - params_of(0, width)
    state = lambda psi: 16 * psi / n + (0 if n == 1 else 8 * unit)  # noqa: E731
    overhead = peak_small - state(params_of(n_small, width))
    return int((row["mem_limit_bytes"] - overhead - (0 if n == 1 else 8 * unit)) * n / 16)


def format_table(rows: list[dict]) -> str:
    ddp = {r["world_size"]: r["largest_params"] for r in rows if r["trainer"] == "ddp"}
    return harness.table(rows, [
        ("trainer", "trainer", ">8"), ("N", "world_size", ">3"),
        ("limit MiB", harness.scaled("mem_limit_bytes", 2**-20), ">9.0f"), ("blocks", "largest_layers", ">6"),
        ("largest params", "largest_params", ">15,"), ("peak MiB", lambda r: (r["peak_bytes"] or 0) / 2**20, ">9.1f"),
        ("ZeRO predicts", "predicted_params", ">14,"),
        ("x DDP", lambda r: harness.ratio(r["largest_params"], ddp.get(r["world_size"])), ">6.2f")])


def run_scale_bench(args) -> int:
    from tqdm import tqdm

    world_sizes = [int(w) for w in str(args.world_sizes).split(",")] if args.world_sizes != "2,4" else [4]
    trainers = [t for t in str(args.trainers).split(",") if t in ("ddp", "ours", "fsdp1")]
    if not trainers or "ours_torch" in str(args.trainers):  # the fsdp bench's default list: use ours
        trainers = ["ddp", "ours", "fsdp1"]
    mem_limit = int(args.mem_limit_mb * 2**20)
    run = harness.BenchRun(f"minifsdp bench scale: the deepest TinyGPT of width {args.width} that takes one AdamW "
                           f"step in {args.mem_limit_mb:g} MiB per rank; {', '.join(trainers)} at "
                           f"{', '.join(map(str, world_sizes))} ranks")
    rows = []
    with tqdm(desc="bench scale (trials)", file=sys.stderr) as bar:
        for n in world_sizes:
            for trainer in trainers:
                row = largest(trainer, n, args.width, mem_limit, max_layers=args.max_layers, bar=bar)
                row["predicted_params"] = predicted_params(row)
                rows.append(row)
    print(format_table(rows))
    run.close("x DDP: the largest model over DDP's at the same world size")
    if args.json:
        harness.save_json(args.json, [dict(r, load_average_1min=harness.load_average()) for r in rows])
        print(f"wrote {args.json}")
    return 0
