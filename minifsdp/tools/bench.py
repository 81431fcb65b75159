"""``python -m minifsdp bench collectives``: our ring all-reduce against gloo's, in the same run.

For each world size, one spawn; inside it, for each message size (1 KB .. max_mb, powers
of 4), the two all-reduces take turns (which goes first alternates), each timed as

    barrier -> t0 -> all_reduce -> t1      time = max over ranks of (t1 - t0)

(the slowest rank is when the collective is done for everyone), median of the repeats
after a warm-up.  Big sizes get fewer repeats so the whole bench stays within minutes.  The
sweep over sizes runs three times and each size's median is over all three: on a shared 2-core
VM a slow minute then touches every size a little instead of one size wholly.

Bus bandwidth = 2(N-1)/N x bytes / time: the bytes each rank really puts on the wire in a
ring all-reduce, per second.  It makes different N comparable; for a bandwidth-bound ring
it is the link speed.  We print the ratio ours / gloo (a ratio measured in one run, on one
machine, the same minute: the only kind of performance claim the book makes).

Two regimes, reported apart: *latency* (messages up to 64 KB: time per call, in microseconds)
and *bus bandwidth* (from 1 MB: GB/s).  Then, per implementation and world size, the
latency-bandwidth model ``t = alpha + beta x bytes`` fitted by least squares on all sizes
(:mod:`minifsdp.tools.bench_fit`): alpha is the fixed cost per call, 1/beta the bandwidth.
With ``--json`` the plot (time against size, log-log, points and fitted lines) is saved next
to the JSON file, as ``<name>.png``.

Which of ours: ``--collectives ring`` (default: the ring tuned for gloo, ``minifsdp.comm.tuned``),
``textbook`` (``minifsdp/comm/ring.py``), or both, ``ring,textbook``: the first is "ours" in the
table and the JSON, each further one gets its own columns (``textbook_s``, ...), all interleaved.

Threads: ranks run with one intra-op thread each (``--threads 1``, the default, as every job of
ours).  ``--threads default`` leaves torch's default (the number of cores) and starts the ranks
with ``torch.multiprocessing``'s spawn, as a user's own launcher would: what a user who runs one
process per machine under torchrun gets (chapters/results/ring_threads.md).

Note: on a laptop every "link" is the loopback interface and every rank shares the same
few cores, so absolute numbers say little; the ratio is the figure of merit.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import statistics
import time

import torch
import torch.distributed as dist

from minifsdp.comm import COLLECTIVE_KINDS, get_collectives
from minifsdp.launch import spawn
from minifsdp.tools.bench_fit import AlphaBeta, fit_alpha_beta

__all__ = ["run_collectives_bench", "bench_sizes", "bus_bandwidth", "fit_rows", "format_latency_bandwidth"]

KB = 1024
LATENCY_MAX = 64 * KB  # up to here a message is latency-bound on loopback: report microseconds
BANDWIDTH_MIN = KB * KB  # from here: report bus bandwidth
IMPLS = ("ours", "gloo")
ROUNDS = 3  # sweeps over all sizes per world size (each with its share of the repeats)


def bench_sizes(max_mb: float) -> list[int]:
    """1 KB, 4 KB, 16 KB, ... up to ``max_mb`` MB (in bytes)."""
    sizes, size = [], KB
    while size <= max_mb * KB * KB:
        sizes.append(size)
        size *= 4
    return sizes


def bus_bandwidth(nbytes: int, world_size: int, seconds: float) -> float:
    """Bytes per second each rank sends in a ring all-reduce of ``nbytes``: 2(N-1)/N x nbytes / time."""
    if world_size == 1 or seconds <= 0:
        return 0.0
    return 2 * (world_size - 1) / world_size * nbytes / seconds


def _repeats(nbytes: int) -> tuple[int, int]:
    """(warm-up, timed) repeats for a message of ``nbytes``."""
    if nbytes <= 256 * KB:  # a small message costs a scheduler tick or two: many repeats for a stable median
        return 5, 60
    if nbytes <= 4 * KB * KB:
        return 3, 40
    return 2, 30  # a 16 MB median over 10 moved by 0.2 from run to run on a busy 2-core VM


def _time_once(fn, tensor) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    fn(tensor)
    elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # done when the slowest rank is done
    return elapsed.item()


def _impls(kinds: tuple[str, ...]) -> dict:
    """{"ours": the first kind's all-reduce, each further kind by its name, "gloo": dist.all_reduce}."""
    ours = {("ours" if i == 0 else kind): get_collectives(kind).all_reduce for i, kind in enumerate(kinds)}
    return {**ours, "gloo": lambda t: dist.all_reduce(t)}


def _bench_rank(sizes: list[int], rounds: int = ROUNDS, kinds: tuple[str, ...] = ("ring",)) -> list[dict]:
    """Body of each rank: every size, every implementation, interleaved; the sweep over sizes ``rounds``
    times, so a slow minute on the machine touches every size a little, not one size wholly."""
    n = dist.get_world_size()
    impls = _impls(kinds)
    times = {nbytes: {name: [] for name in impls} for nbytes in sizes}
    tensors = {nbytes: torch.zeros(nbytes // 4) for nbytes in sizes}  # zeros: the sums stay finite
    for _ in range(rounds):
        for nbytes in sizes:
            warmup, repeats = _repeats(nbytes)
            for i in range(warmup + -(-repeats // rounds)):
                order = list(impls) if i % 2 == 0 else list(reversed(impls))
                for name in order:
                    seconds = _time_once(impls[name], tensors[nbytes])
                    if i >= warmup:
                        times[nbytes][name].append(seconds)
    rows = []
    for nbytes in sizes:
        row = {"world_size": n, "bytes": nbytes, "repeats": len(times[nbytes]["ours"])}
        for name, ts in times[nbytes].items():
            median = statistics.median(ts)
            row[f"{name}_s"] = median
            row[f"{name}_busbw_GBps"] = bus_bandwidth(nbytes, n, median) / 1e9
        for name in impls:
            if name != "gloo":  # bus bandwidth ratio
                row[f"ratio_{name}_over_gloo"] = row["gloo_s"] / row[f"{name}_s"]
        row["threads_per_rank"] = torch.get_num_threads()
        rows.append(row)
    return rows


def _human(nbytes: int) -> str:
    for unit, scale in (("MB", KB * KB), ("KB", KB)):
        if nbytes >= scale:
            return f"{nbytes / scale:g} {unit}"
    return f"{nbytes} B"


def format_table(rows: list[dict]) -> str:
    header = ('N', 'size', 'ours ms', 'gloo ms', 'ours GB/s', 'gloo GB/s', 'ours/gloo')
    lines = [' '.join(f'{h:>{w}}' for h, w in zip(header, (3, 8, 9, 9, 10, 10, 10)))]
    for r in rows:
        lines.append(
            f"{r['world_size']:>3} {_human(r['bytes']):>8} {r['ours_s'] * 1e3:>9.3f} {r['gloo_s'] * 1e3:>9.3f} "
            f"{r['ours_busbw_GBps']:>10.3f} {r['gloo_busbw_GBps']:>10.3f} {r['ratio_ours_over_gloo']:>10.2f}"
        )
    return "\n".join(lines)


def _kinds(text: str) -> tuple[str, ...]:
    kinds = tuple(k.strip() for k in str(text).split(",") if k.strip())
    ours = tuple(k for k in COLLECTIVE_KINDS if k != "torch")
    if not kinds or any(k not in ours for k in kinds) or len(set(kinds)) < len(kinds):
        raise SystemExit(f"--collectives must list some of {ours} (ours; gloo is always measured), "
                         f"e.g. ring or ring,textbook; got {text!r}")
    return kinds


@contextlib.contextmanager
def _start_method(threads: int | None):
    """torch's default threads: ranks started with torch.multiprocessing's spawn, as a user's own launcher."""
    saved = os.environ.get("MINIFSDP_START_METHOD")
    if threads is None:
        os.environ["MINIFSDP_START_METHOD"] = "spawn"
    try:
        yield "spawn" if threads is None else (saved or "forkserver")
    finally:
        if saved is None:
            os.environ.pop("MINIFSDP_START_METHOD", None)
        else:
            os.environ["MINIFSDP_START_METHOD"] = saved


def run_collectives_bench(args) -> int:
    """Entry point of ``python -m minifsdp bench collectives`` (args: world_sizes, max_mb, json, collectives,
    threads: an int, or None for torch's default)."""
    world_sizes = [int(w) for w in str(args.world_sizes).split(",") if w.strip()]
    if not world_sizes or any(w < 2 for w in world_sizes):
        raise SystemExit(f"--world-sizes must list sizes >= 2, e.g. 2,4; got {args.world_sizes!r}")
    sizes = bench_sizes(args.max_mb)
    if not sizes:
        raise SystemExit(f"--max-mb={args.max_mb} is below the smallest size (1 KB); use e.g. --max-mb 64")
    kinds, threads = _kinds(getattr(args, "collectives", "ring")), getattr(args, "threads", 1)
    rows, started = [], time.perf_counter()
    print(f"ours = {kinds[0]}" + "".join(f", then {k}" for k in kinds[1:]) + f" against gloo; intra-op threads "
          f"per rank: {threads or 'torch default'}; load average {load_average():.1f}", flush=True)
    with _start_method(threads) as start_method:
        for n in world_sizes:
            print(f"world size {n}: {len(sizes)} sizes from {_human(sizes[0])} to {_human(sizes[-1])} ...", flush=True)
            rows += spawn(_bench_rank, args=(sizes, ROUNDS, kinds), world_size=n, timeout_s=600,
                          threads_per_rank=threads)[0]
    print(format_table(rows))
    for kind in kinds[1:]:
        print(f"{kind}: " + ", ".join(f"N={r['world_size']} {_human(r['bytes'])} {r[f'ratio_{kind}_over_gloo']:.2f}"
                                      for r in rows) + " (speed / gloo)")
    fits = fit_rows(rows)
    print(format_latency_bandwidth(rows, fits))
    big = [r["ratio_ours_over_gloo"] for r in rows if r["bytes"] >= 4 * KB * KB]
    if big:
        print(f"ours / gloo bus bandwidth from 4 MB up: min {min(big):.2f}, median {statistics.median(big):.2f}")
    print(f"({time.perf_counter() - started:.0f} s; ratio > 1 means ours is faster; "
          f"load average {load_average():.1f} on {os.cpu_count()} CPUs: other work on the machine makes times noisy)")
    if args.json:
        fit_meta = {f"{impl}@{n}": {"alpha_s": f.alpha, "beta_s_per_byte": f.beta, "rms_relative_error":
                                    f.rms_relative_error} for (impl, n), f in fits.items()}
        write_bench_json(args.json, rows, threads_per_rank=threads or "torch default", collectives=list(kinds),
                         start_method=start_method, alpha_beta=fit_meta)
        print(f"wrote {args.json}")
        png = os.path.splitext(args.json)[0] + ".png"
        plot_collectives(rows, fits, png)
        print(f"saved {png}")
    return 0


def fit_rows(rows: list[dict]) -> dict[tuple[str, int], AlphaBeta]:
    """{(implementation, world size): alpha-beta fit of its median times over every size}."""
    fits = {}
    for n in sorted({r["world_size"] for r in rows}):
        mine = [r for r in rows if r["world_size"] == n]
        if len({r["bytes"] for r in mine}) < 2:
            continue
        for impl in IMPLS:
            fits[(impl, n)] = fit_alpha_beta([r["bytes"] for r in mine], [r[f"{impl}_s"] for r in mine])
    return fits


def format_latency_bandwidth(rows: list[dict], fits: dict[tuple[str, int], AlphaBeta]) -> str:
    """Latency (small sizes, us) and bus bandwidth (large sizes, GB/s) apart, then the fits."""
    lines = [f"latency (up to {_human(LATENCY_MAX)}): us per all-reduce, ours vs gloo"]
    for r in rows:
        if r["bytes"] <= LATENCY_MAX:
            lines.append(f"  N={r['world_size']} {_human(r['bytes']):>7}: ours {r['ours_s'] * 1e6:8.0f}  "
                         f"gloo {r['gloo_s'] * 1e6:8.0f}  speed ours/gloo {r['ratio_ours_over_gloo']:.2f}")
    lines.append(f"bus bandwidth (from {_human(BANDWIDTH_MIN)}): GB/s, ours vs gloo")
    for r in rows:
        if r["bytes"] >= BANDWIDTH_MIN:
            lines.append(f"  N={r['world_size']} {_human(r['bytes']):>7}: ours {r['ours_busbw_GBps']:7.3f}  "
                         f"gloo {r['gloo_busbw_GBps']:7.3f}  speed ours/gloo {r['ratio_ours_over_gloo']:.2f}")
    lines.append("alpha-beta fit, t = alpha + beta x bytes (least squares on relative error, every size):")
    for (impl, n), f in fits.items():
        lines.append(f"  N={n} {impl:>4}: {f.describe()}")
    return "\n".join(lines)


def plot_collectives(rows: list[dict], fits: dict[tuple[str, int], AlphaBeta], path: str) -> None:
    """Time per all-reduce against message size (log-log): measured points and the fitted lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for (impl, n), f in fits.items():
        mine = [r for r in rows if r["world_size"] == n]
        xs = [r["bytes"] for r in mine]
        line = ax.loglog(xs, [r[f"{impl}_s"] for r in mine], "o" if impl == "ours" else "s",
                         label=f"{impl}, N={n}")[0]
        ax.loglog(xs, [f.predict(b) for b in xs], "-", color=line.get_color(), alpha=0.6,
                  label=f"fit: {f.alpha * 1e6:.0f} us + b / {f.bandwidth / 1e9:.2f} GB/s")
    ax.set_xlabel("message size (bytes)")
    ax.set_ylabel("time per all-reduce (s)")
    ax.set_title("ring all-reduce (ours) vs gloo: alpha-beta fit")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def load_average() -> float:
    """The machine's 1-minute load average: printed beside every figure, since other work skews times."""
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")


def write_bench_json(path: str, rows: list[dict], **meta) -> None:
    """Write ``{"meta": machine + torch versions + load + meta, "rows": rows}`` to ``path``."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    meta = {"torch": torch.__version__, "python": platform.python_version(), "machine": platform.machine(),
            "cpus": os.cpu_count(), "load_average_1min": load_average(), **meta}
    with open(path, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
