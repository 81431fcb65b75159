"""One harness for every bench: start the ranks, let the contenders take turns, keep medians, print ratios.

A bench says only what it measures: which contenders it builds (ours and torch's, the same model, the same
data) and what one timed round of each does (a training step, one all-reduce).  This module does the rest,
the same way for every bench, so that a figure from one bench reads like a figure from any other::

    the command (parent)                        every rank (one spawn per world size)
    ----------------------------------------    ----------------------------------------------------------
    run = BenchRun("bench fsdp: ...")  # load   contenders = {"ours": step_ours, "fsdp1": step_torch}
    for n in world_sizes("2,4"):                timings = interleave(contenders, rounds=8, warmup=1)
        out = run_ranks(rank_fn, args, n)           round i: the names rotated by i; each call timed as
    rows: medians, add_ratios(rows, ...)                barrier -> sync -> t0 -> call -> sync -> t1
    print(table(rows, columns))                     each time the max over ranks (one all-reduce at the end)
    run.close(...); save_rows(path, rows)       timings.median("ours") / timings.median("fsdp1")

Note (turns): on a machine shared with other work, a slow minute then slows every contender a little
instead of one wholly, and a figure is a ratio measured in one run (the same processes, the same minutes),
never an absolute time.  The load average is printed at the start and at the end, and saved with the rows.

Note (the slowest rank): a step is done when the slowest rank is done, so each time is the max over ranks.

Note (CUDA): ``sync`` waits for the GPU's queued work before t0 and after the call (``torch.cuda.
synchronize``); without it a time would measure the launch of the kernels, not their work.  On the CPU it
does nothing, and the CPU benches take the same path.
"""

from __future__ import annotations

import json
import os
import platform
import re
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable
from unittest import mock

import torch
import torch.distributed as dist

from minifsdp.launch import spawn
from minifsdp.training.devices import synchronize

__all__ = ["ContenderError", "Timings", "interleave", "spread", "ratio", "add_ratios", "scaled", "table",
           "BenchRun", "run_ranks", "world_sizes", "choose", "say_on_rank0", "load_average", "save_json",
           "save_rows"]

CPU = torch.device("cpu")


class ContenderError(RuntimeError):
    """One contender's round raised; the message names the contender and the round."""


@dataclass
class Timings:
    """The seconds of every timed round, per contender, each the max over ranks: ``wall`` (the clock) and
    ``cpu`` (``time.process_time``: every thread of the process; steadier than the clock on a busy machine)."""

    wall: dict[str, list[float]]
    cpu: dict[str, list[float]]

    def median(self, name: str) -> float:
        return statistics.median(self.wall[name])


def interleave(contenders: dict[str, Callable[[], Any]], rounds: int, warmup: int = 0, device=CPU,
               say: Callable[[str], None] | None = None) -> Timings:
    """Call every contender once per round, in turns, and time each call (run on every rank at once).

    The first ``warmup`` rounds are not kept.  ``device``: where ``sync`` waits (a CUDA device) and the
    times are reduced.  ``say``: a progress printer, called after every round (``say_on_rank0``).

    Raises:
        ContenderError: a contender raised; the message names it and the round.
    """
    names = list(contenders)
    if not names or rounds < 1 or warmup < 0:
        raise ValueError(f"interleave: needs contenders, rounds >= 1 and warmup >= 0; got {names}, {rounds}, {warmup}")
    wall: dict[str, list[float]] = {n: [] for n in names}
    cpu: dict[str, list[float]] = {n: [] for n in names}
    for i in range(warmup + rounds):
        for name in names[i % len(names):] + names[:i % len(names)]:  # rotated: none always first or last
            seconds, cpu_seconds = _time_round(name, contenders[name], i, device)
            if i >= warmup:
                wall[name].append(seconds)
                cpu[name].append(cpu_seconds)
        if say is not None:
            say(f"warm-up round {i + 1}/{warmup} done" if i < warmup else f"round {i + 1 - warmup}/{rounds}: "
                + ", ".join(f"{n} {wall[n][-1] * 1e3:.1f} ms" for n in names))
    return _slowest_rank(names, wall, cpu, device)


def _world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _time_round(name: str, call: Callable[[], Any], i: int, device) -> tuple[float, float]:
    """barrier -> sync -> t0 -> call -> sync -> t1: (wall, CPU) seconds on this rank."""
    if _world_size() > 1:
        dist.barrier()  # every rank starts together: the time is the call's, not a late rank's
    synchronize(device)
    t0, c0 = time.perf_counter(), time.process_time()
    try:
        call()
    except Exception as e:
        raise ContenderError(f"bench contender {name!r} failed in round {i + 1}: {type(e).__name__}: {e}") from e
    synchronize(device)
    return time.perf_counter() - t0, time.process_time() - c0


def _slowest_rank(names: list[str], wall: dict, cpu: dict, device) -> Timings:
    """Every time the max over ranks: one all-reduce of them all, on ``device`` (NCCL reduces only there)."""
    if _world_size() == 1:
        return Timings(wall, cpu)
    times = torch.tensor([[wall[n], cpu[n]] for n in names], dtype=torch.float64, device=device)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    times = times.tolist()
    return Timings({n: times[k][0] for k, n in enumerate(names)}, {n: times[k][1] for k, n in enumerate(names)})


def spread(values: list[float]) -> float:
    """(max - min) / median: how far apart the rounds were, relative to the figure kept."""
    return (max(values) - min(values)) / statistics.median(values)


def ratio(value: float | None, reference: float | None) -> float | None:
    """``value / reference``, the one way a bench states a figure: for a time below 1 is faster, for bytes
    smaller.  None where either is missing or the reference is 0."""
    if value is None or not reference:
        return None
    return value / reference


def add_ratios(rows: list[dict], key: str, out: str, reference: str, name: str = "trainer",
               same: tuple[str, ...] = ("world_size",)) -> list[dict]:
    """Set ``row[out]`` = ``row[key]`` over the reference row's: the row whose ``name`` is ``reference`` and
    which agrees on every field of ``same`` (the same run); None where there is no such row."""
    for row in rows:
        ref = next((r for r in rows if r.get(name) == reference and all(r.get(f) == row.get(f) for f in same)),
                   None)
        row[out] = ratio(row.get(key), ref.get(key)) if ref is not None else None
    return rows


def scaled(key: str, factor: float) -> Callable[[dict], float | None]:
    """A table column's value: the row's ``key`` times ``factor`` (1e3: seconds in ms; 2**-20: bytes in MiB)."""
    return lambda row: row[key] * factor if row.get(key) is not None else None


def table(rows: list[dict], columns: list[tuple]) -> str:
    """A heading line, then one line per row.  ``columns``: (heading, value, spec); ``value`` is a key of the
    row or a function of it, ``spec`` a format spec with its width (``">9.3f"``, ``"<11"``); None shows "-"."""
    def layout(spec: str) -> str:  # the alignment and width of a spec: a heading or a "-" gets the same
        align, width = re.match(r"([<>^]?)[-+ ]?(\d*)", spec).groups()
        return (align or ">") + width

    def cell(row: dict, value, spec: str) -> str:
        v = value(row) if callable(value) else row.get(value)
        return format("-", layout(spec)) if v is None else format(v, spec)

    lines = [" ".join(format(head, layout(spec)) for head, _, spec in columns)]
    lines += [" ".join(cell(row, value, spec) for _, value, spec in columns) for row in rows]
    return "\n".join(line.rstrip() for line in lines)


def load_average() -> float:
    """The machine's 1-minute load average: printed beside every figure, since other work skews times."""
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")


class BenchRun:
    """One bench command from its first line to its last: what runs and the load average at the start,
    then the closing line (seconds taken, the load at the end)."""

    def __init__(self, headline: str):
        self.started, self.load_at_start = time.perf_counter(), load_average()
        print(f"{headline}; load average {self.load_at_start:.1f} on {os.cpu_count()} CPUs", flush=True)

    def close(self, note: str) -> None:
        print(f"({time.perf_counter() - self.started:.0f} s; {note}; load average {self.load_at_start:.1f} at the "
              f"start, {load_average():.1f} at the end: other work on the machine makes times noisy)", flush=True)


def run_ranks(fn: Callable[..., Any], args: tuple, world_size: int, *, threads: int | None = 1,
              env: dict[str, str] | None = None, timeout_s: float = 3600, backend: str | None = None) -> list:
    """``minifsdp.spawn(fn, args)`` on ``world_size`` ranks, ``threads`` intra-op threads each (None: torch's
    default), with ``env`` added to their environment (ranks copy the parent's as they start; it is restored)."""
    with mock.patch.dict(os.environ, env or {}):  # os.environ as it was, once the ranks are done
        return spawn(fn, args, world_size=world_size, backend=backend, timeout_s=timeout_s, threads_per_rank=threads)


def world_sizes(text, smallest: int = 2) -> list[int]:
    """``--world-sizes``: "2,4" -> [2, 4]; every size at least ``smallest``."""
    parts = [w.strip() for w in str(text).split(",") if w.strip()]
    sizes = [int(w) for w in parts if w.isdigit()]
    if not sizes or len(sizes) < len(parts) or min(sizes) < smallest:
        raise SystemExit(f"--world-sizes must list sizes >= {smallest}, e.g. {smallest},4; got {text!r}")
    return sizes


def choose(text, allowed, what: str) -> list[str]:
    """A comma-separated option: each item one of ``allowed``, each at most once."""
    items = [v.strip() for v in str(text).split(",") if v.strip()]
    bad = [v for v in items if v not in allowed]
    if bad or not items or len(set(items)) < len(items):
        raise SystemExit(f"{what}: {f'unknown {bad}' if bad else repr(text)}; list some of {','.join(allowed)}, "
                         "each once")
    return items


def say_on_rank0(label: str) -> Callable[[str], None]:
    """A progress printer for a rank function: rank 0 prints ``  [label] message``, the other ranks nothing."""
    if dist.is_initialized() and dist.get_rank() != 0:
        return lambda message: None
    return lambda message: print(f"  [{label}] {message}", flush=True)


def save_json(path: str, payload) -> None:
    """Write ``payload`` to ``path`` (its folder made), indented."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(payload, f, indent=1, default=str)


def save_rows(path: str, rows: list[dict], **meta) -> None:
    """Write ``{"meta": machine, torch, load average and ``meta``, "rows": rows}`` to ``path``."""
    meta = {"torch": torch.__version__, "python": platform.python_version(), "machine": platform.machine(),
            "cpus": os.cpu_count(), "load_average_1min": load_average(), **meta}
    save_json(path, {"meta": meta, "rows": rows})
