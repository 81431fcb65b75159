"""``python -m minifsdp bench collectives``: our ring all-reduce against gloo's, in the same run.

For each world size, one spawn; inside it, at each message size (1 KB .. max_mb, powers of 4),
one all-reduce of each implementation per round, timed by the bench harness
(:mod:`minifsdp.bench.harness`: turns, each time the slowest rank's, the median after a
warm-up).  Big sizes get fewer repeats so the whole bench stays within minutes.  The sweep over
sizes runs three times and each size's median is over all three: on a shared 2-core VM a slow
minute then touches every size a little instead of one size wholly.

Bus bandwidth = 2(N-1)/N x bytes / time: the bytes each rank really puts on the wire in a
ring all-reduce, per second.  It makes different N comparable; for a bandwidth-bound ring
it is the link speed.  We print the ratio ours / gloo (a ratio measured in one run, on one
machine, the same minute: the only kind of performance claim the book makes).

Two regimes, reported apart: *latency* (messages up to 64 KB: time per call, in microseconds)
and *bus bandwidth* (from 1 MB: GB/s).  Then, per implementation and world size, the
latency-bandwidth model ``t = alpha + beta x bytes`` fitted by least squares on all sizes
(:mod:`minifsdp.bench.fit`): alpha is the fixed cost per call, 1/beta the bandwidth.
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

import functools
import os
import statistics

import torch
import torch.distributed as dist

from minifsdp.bench import harness
from minifsdp.bench.fit import AlphaBeta, fit_alpha_beta
from minifsdp.comm import COLLECTIVE_KINDS, get_collectives

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


def _impls(kinds: tuple[str, ...]) -> dict:
    """{"ours": the first kind's all-reduce, each further kind by its name, "gloo": dist.all_reduce}."""
    ours = {("ours" if i == 0 else kind): get_collectives(kind).all_reduce for i, kind in enumerate(kinds)}
    return {**ours, "gloo": lambda t: dist.all_reduce(t)}


def _bench_rank(sizes: list[int], rounds: int = ROUNDS, kinds: tuple[str, ...] = ("ring",)) -> list[dict]:
    """Body of each rank: at every size the implementations take turns (one all-reduce each per round); the
    sweep over sizes ``rounds`` times, so a slow minute on the machine touches every size a little."""
    n, impls = dist.get_world_size(), _impls(kinds)
    times = {nbytes: {name: [] for name in impls} for nbytes in sizes}
    tensors = {nbytes: torch.zeros(nbytes // 4) for nbytes in sizes}  # zeros: the sums stay finite
    for _ in range(rounds):
        for nbytes in sizes:
            warmup, repeats = _repeats(nbytes)
            calls = {name: functools.partial(fn, tensors[nbytes]) for name, fn in impls.items()}
            for name, seconds in harness.interleave(calls, -(-repeats // rounds), warmup).wall.items():
                times[nbytes][name] += seconds
    rows = []
    for nbytes in sizes:
        row = {"world_size": n, "bytes": nbytes, "repeats": len(times[nbytes]["ours"])}
        for name, ts in times[nbytes].items():
            row[f"{name}_s"] = statistics.median(ts)
            row[f"{name}_busbw_GBps"] = bus_bandwidth(nbytes, n, row[f"{name}_s"]) / 1e9
        for name in impls:
            if name != "gloo":  # speed against gloo: gloo's time over ours
                row[f"ratio_{name}_over_gloo"] = harness.ratio(row["gloo_s"], row[f"{name}_s"])
        row["threads_per_rank"] = torch.get_num_threads()
        rows.append(row)
    return rows


def _human(nbytes: int) -> str:
    for unit, scale in (("MB", KB * KB), ("KB", KB)):
        if nbytes >= scale:
            return f"{nbytes / scale:g} {unit}"
    return f"{nbytes} B"


def format_table(rows: list[dict]) -> str:
    return harness.table(rows, [
        ("N", "world_size", ">3"), ("size", lambda r: _human(r["bytes"]), ">8"),
        ("ours ms", harness.scaled("ours_s", 1e3), ">9.3f"), ("gloo ms", harness.scaled("gloo_s", 1e3), ">9.3f"),
        ("ours GB/s", "ours_busbw_GBps", ">10.3f"), ("gloo GB/s", "gloo_busbw_GBps", ">10.3f"),
        ("ours/gloo", "ratio_ours_over_gloo", ">10.2f")])


def run_collectives_bench(args) -> int:
    """Entry point of ``python -m minifsdp bench collectives`` (args: world_sizes, max_mb, json, collectives,
    threads: an int, or None for torch's default)."""
    sizes_n = harness.world_sizes(args.world_sizes)
    sizes = bench_sizes(args.max_mb)
    if not sizes:
        raise SystemExit(f"--max-mb={args.max_mb} is below the smallest size (1 KB); use e.g. --max-mb 64")
    kinds = tuple(harness.choose(getattr(args, "collectives", "ring"), [k for k in COLLECTIVE_KINDS if k != "torch"],
                         "--collectives (ours; gloo is always measured)"))
    threads = getattr(args, "threads", 1)
    # torch's default threads: ranks started with torch.multiprocessing's spawn, as a user's own launcher
    start_method = "spawn" if threads is None else os.environ.get("MINIFSDP_START_METHOD", "forkserver")
    run = harness.BenchRun(f"ours = {kinds[0]}" + "".join(f", then {k}" for k in kinds[1:]) + " against gloo; intra-op "
                   f"threads per rank: {threads or 'torch default'}")
    rows = []
    for n in sizes_n:
        print(f"world size {n}: {len(sizes)} sizes from {_human(sizes[0])} to {_human(sizes[-1])} ...", flush=True)
        rows += harness.run_ranks(_bench_rank, (sizes, ROUNDS, kinds), n, threads=threads, timeout_s=600,
                          env={"MINIFSDP_START_METHOD": start_method})[0]
    print(format_table(rows))
    for kind in kinds[1:]:
        print(f"{kind}: " + ", ".join(f"N={r['world_size']} {_human(r['bytes'])} {r[f'ratio_{kind}_over_gloo']:.2f}"
                                      for r in rows) + " (speed / gloo)")
    fits = fit_rows(rows)
    print(format_latency_bandwidth(rows, fits))
    big = [r["ratio_ours_over_gloo"] for r in rows if r["bytes"] >= 4 * KB * KB]
    if big:
        print(f"ours / gloo bus bandwidth from 4 MB up: min {min(big):.2f}, median {statistics.median(big):.2f}")
    run.close("ratio > 1 means ours is faster")
    if args.json:
        fit_meta = {f"{impl}@{n}": {"alpha_s": f.alpha, "beta_s_per_byte": f.beta, "rms_relative_error":
                                    f.rms_relative_error} for (impl, n), f in fits.items()}
        harness.save_rows(args.json, rows, threads_per_rank=threads or "torch default", collectives=list(kinds),
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
