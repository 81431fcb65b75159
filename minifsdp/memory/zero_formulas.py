"""Chapters 2.3 and 2.4: model-state bytes per rank, from the ZeRO paper's formulas.

Training with Adam keeps three kinds of *model state* per parameter (Ψ = the
number of parameters, N = the number of data-parallel ranks):

                         parameters   gradients   optimizer state      total
    paper (mixed prec.)     2Ψ  fp16     2Ψ  fp16    12Ψ  fp32 master     16Ψ
                                                     copy + m + v
    this book (fp32 CPU)    4Ψ           4Ψ           8Ψ  m + v           16Ψ

ZeRO (Rajbhandari et al. 2019) shards them stage by stage:

    stage  torch name       parameters  gradients  optimizer    mixed (paper)     fp32 (here)
    0      DDP / NO_SHARD   full        full       full         16Ψ               16Ψ
    1      (ZeRO-1)         full        full       1/N          4Ψ + 12Ψ/N        8Ψ + 8Ψ/N
    2      SHARD_GRAD_OP    full        1/N        1/N          2Ψ + 14Ψ/N        4Ψ + 12Ψ/N
    3      FULL_SHARD       1/N         1/N        1/N          16Ψ/N             16Ψ/N

Note (what torch's strategies really hold, measured by tests/test_memory.py):
the formulas count one copy of each state.  Torch FSDP keeps the local shard
*and*, while it is in use, a separate all-gathered copy.  So SHARD_GRAD_OP
holds 16Ψ/N between steps (everything sharded) and 4Ψ + 16Ψ/N from the
forward to the end of the backward (the unsharded copy stays); FULL_SHARD
holds 16Ψ/N plus one or two units' unsharded parameters at a time.  FSDP also
pads each unit's flat parameter to a multiple of N (:func:`sharded_numel`), and
torch's Adam keeps a 4-byte ``step`` tensor per optimized tensor.

    fsdp_model_state_bytes(units, N)      # exact, padding and AdamW's step included (exercise 2.3b)
    bytes_sent_per_step(units, N, "FULL_SHARD")   # chapter 2.4: what our ring sends in one step (exercise 2.4)

    rows = memory_rows(num_params=29_568, world_sizes=[1, 2, 4, 8])
    print(format_rows(rows)); plot_memory_vs_world_size(rows)
    plot_timeline(tracker)     # a measured step (minifsdp.memory.MemoryTracker) beside the formulas
"""

from __future__ import annotations

import math
from typing import Iterable

from minifsdp.comm.ring import chunk_bounds

__all__ = [
    "BYTES_PER_PARAM",
    "STAGE_OF",
    "model_state_bytes",
    "sharded_numel",
    "fsdp_model_state_bytes",
    "ring_all_reduce_bytes_sent",
    "bytes_sent_per_step",
    "memory_rows",
    "format_rows",
    "plot_memory_vs_world_size",
    "plot_timeline",
]

# bytes per parameter of (parameters, gradients, optimizer state)
BYTES_PER_PARAM = {
    "fp32_adam": (4, 4, 8),  # what we train here: fp32 weights and grads, Adam's m and v in fp32
    "mixed_adam": (2, 2, 12),  # the ZeRO paper: fp16 weights and grads; fp32 master weights, m, v
}

STAGE_OF = {
    "DDP": 0,
    "NO_SHARD": 0,
    "ZERO_1": 1,
    "SHARD_GRAD_OP": 2,
    "ZERO_2": 2,
    "FULL_SHARD": 3,
    "ZERO_3": 3,
}


def _stage(strategy: str | int) -> int:
    if isinstance(strategy, int) and strategy in (0, 1, 2, 3):
        return strategy
    key = str(strategy).upper().replace("-", "_").replace("SHARDINGSTRATEGY.", "")
    if key not in STAGE_OF:
        raise ValueError(f"unknown strategy {strategy!r}; use one of {sorted(STAGE_OF)} or a ZeRO stage 0-3.")
    return STAGE_OF[key]


def model_state_bytes(
    num_params: int, world_size: int, strategy: str | int, precision: str = "fp32_adam", extra_optimizer_bytes: int = 0
) -> dict[str, float]:
    """Per-rank bytes of parameters, gradients and optimizer state under a ZeRO stage.

    Args:
        num_params: Ψ, unique parameters (a tied weight counts once). For an exact
            FSDP prediction pass ``sharded_numel(units, N) * N`` (padding included).
        world_size: N, ranks sharing the state.
        strategy: "DDP", "SHARD_GRAD_OP", "FULL_SHARD", "ZERO_1".."ZERO_3" or a stage 0-3.
        precision: "fp32_adam" (4 + 4 + 8 bytes) or "mixed_adam" (the paper's 2 + 2 + 12).
        extra_optimizer_bytes: per-rank optimizer bytes outside the formula (torch Adam's
            4-byte ``step`` tensor per optimized tensor).

    Returns:
        {"parameters", "gradients", "optimizer_state", "total"} in bytes (floats: Ψ/N need not be whole).
    """
    if precision not in BYTES_PER_PARAM:
        raise ValueError(f"unknown precision {precision!r}; use one of {sorted(BYTES_PER_PARAM)}.")
    if world_size < 1 or num_params < 0:
        raise ValueError(f"need world_size >= 1 and num_params >= 0, got {world_size} and {num_params}.")
    stage = _stage(strategy)
    p, g, o = BYTES_PER_PARAM[precision]
    n = world_size
    out = {
        "parameters": p * num_params / (n if stage >= 3 else 1),
        "gradients": g * num_params / (n if stage >= 2 else 1),
        "optimizer_state": o * num_params / (n if stage >= 1 else 1) + extra_optimizer_bytes,
    }
    out["total"] = sum(out.values())
    return out


def sharded_numel(unit_numels: Iterable[int], world_size: int) -> int:
    """Elements of each rank's shards: every unit's flat parameter padded to a multiple of N, then split.

        unit of 10 elements, N = 4:  [0 1 2 | 3 4 5 | 6 7 8 | 9 p p]  -> 3 per rank (2 of them padding)
    """
    return sum(math.ceil(n / world_size) for n in unit_numels)


def ring_all_reduce_bytes_sent(numel: int, world_size: int, rank: int, itemsize: int = 4) -> int:
    """Bytes ``rank`` sends in our ring all-reduce of ``numel`` elements (``minifsdp.comm.ring``).

    The reduce-scatter sends every chunk but chunk ``rank``, the all-gather every chunk but chunk
    ``rank + 1``: 2(N-1)/N of the data when N divides it, a few elements off per rank when not.
    """
    sizes = [b - a for a, b in chunk_bounds(numel, world_size)]
    if world_size == 1:
        return 0
    return (2 * numel - sizes[rank % world_size] - sizes[(rank + 1) % world_size]) * itemsize


# >>> student edition: cut; exercises/memory_tasks.py runs here (tasks 2.3b, 2.4)
def fsdp_model_state_bytes(unit_numels: Iterable[int], world_size: int) -> int:
    """Our FSDP's (and torch FSDP1's) fp32 AdamW model state per rank at rest, exactly (exercise 2.3b).

    ``unit_numels``: each unit's unpadded flat-parameter numel.  The shards (padding included)
    times 4 + 4 + 8 bytes, plus AdamW's 4-byte ``step`` tensor per optimized flat parameter.
    FULL_SHARD and SHARD_GRAD_OP between steps; NO_SHARD (and one rank) is ``world_size=1``.
    """
    units = list(unit_numels)
    shard = sharded_numel(units, world_size)
    total = model_state_bytes(shard * world_size, world_size, "FULL_SHARD", extra_optimizer_bytes=4 * len(units))
    return int(total["total"])


def bytes_sent_per_step(unit_numels: Iterable[int], world_size: int, strategy: str, itemsize: int = 4,
                        rank: int = 0) -> int:
    """Bytes one rank sends through our ring collectives in one training step (exercise 2.4).

    ``unit_numels``: unpadded flat-parameter numels, the root unit first.  DDP: one all-reduce of
    the whole model (one bucket).  FSDP pads each unit to a multiple of N; each all-gather or
    reduce-scatter sends (N-1)/N of it.  FULL_SHARD gathers every unit in the forward and every
    unit but the root again in the backward (the root is not freed after the forward, as in
    torch FSDP1); SHARD_GRAD_OP gathers once; both reduce-scatter every unit; NO_SHARD all-reduces
    each unit (unpadded).  Headers and DDP's buffer broadcasts (not ring traffic) are not counted.
    """
    units, n = list(unit_numels), world_size
    key = str(strategy).upper().replace("SHARDINGSTRATEGY.", "")
    if n == 1:
        return 0  # FSDP falls back to NO_SHARD; a ring of one sends nothing
    if key == "DDP":
        return ring_all_reduce_bytes_sent(sum(units), n, rank, itemsize)
    if key == "NO_SHARD":
        return sum(ring_all_reduce_bytes_sent(u, n, rank, itemsize) for u in units)
    one = [math.ceil(u / n) * (n - 1) * itemsize for u in units]  # (N-1)/N of the padded unit
    if key == "SHARD_GRAD_OP":
        return 2 * sum(one)
    if key == "FULL_SHARD":
        return 3 * sum(one) - one[0]
    raise ValueError(f"unknown strategy {strategy!r}; use DDP, FULL_SHARD, SHARD_GRAD_OP or NO_SHARD.")
# <<< student edition


def memory_rows(
    num_params: int,
    world_sizes: Iterable[int] = (1, 2, 4, 8),
    strategies: Iterable[str] = ("DDP", "SHARD_GRAD_OP", "FULL_SHARD"),
    precision: str = "fp32_adam",
    measured: dict[tuple[str, int], float] | None = None,
) -> list[dict]:
    """One row per (strategy, world size): the formula's total and, where given, the measured bytes.

    ``measured`` maps (strategy, world_size) -> measured per-rank model-state bytes
    (e.g. ``snapshot(...)`` parameters + gradients + optimizer_state).
    """
    measured = measured or {}
    rows = []
    for strategy in strategies:
        for n in world_sizes:
            formula = model_state_bytes(num_params, n, strategy, precision)["total"]
            got = measured.get((strategy, n))
            rows.append(
                {
                    "strategy": strategy,
                    "world_size": n,
                    "formula_bytes": formula,
                    "measured_bytes": got,
                    "measured_over_formula": None if got is None else got / formula,
                }
            )
    return rows


def format_rows(rows: list[dict]) -> str:
    """A plain-text table of :func:`memory_rows` output, in KiB."""
    lines = [f"{'strategy':<14} {'N':>3} {'formula KiB':>12} {'measured KiB':>13} {'ratio':>7}"]
    for r in rows:
        got = "-" if r["measured_bytes"] is None else f"{r['measured_bytes'] / 1024:.1f}"
        ratio = "-" if r["measured_over_formula"] is None else f"{r['measured_over_formula']:.3f}"
        formula = r["formula_bytes"] / 1024
        lines.append(f"{r['strategy']:<14} {r['world_size']:>3} {formula:>12.1f} {got:>13} {ratio:>7}")
    return "\n".join(lines)


def plot_memory_vs_world_size(rows: list[dict], ax=None, title: str = "model state per rank"):
    """Formula lines (one per strategy) and measured points, bytes per rank against world size.

    Returns the matplotlib Figure.  Uses whatever backend is active; in tests and
    scripts set ``matplotlib.use("Agg")`` first.
    """
    import matplotlib.pyplot as plt

    if ax is None:
        fig, ax = plt.subplots(figsize=(6, 4))
    else:
        fig = ax.figure
    for i, strategy in enumerate(dict.fromkeys(r["strategy"] for r in rows)):
        mine = sorted((r for r in rows if r["strategy"] == strategy), key=lambda r: r["world_size"])
        color = f"C{i}"
        ax.plot([r["world_size"] for r in mine], [r["formula_bytes"] / 1024 for r in mine], "-", color=color,
                label=f"{strategy} (formula)")
        pts = [r for r in mine if r["measured_bytes"] is not None]
        if pts:
            ax.plot([r["world_size"] for r in pts], [r["measured_bytes"] / 1024 for r in pts], "o", color=color,
                    label=f"{strategy} (measured)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("world size N (ranks)")
    ax.set_ylabel("KiB per rank")
    ax.set_title(title)
    ax.legend(fontsize="small")
    return fig


def plot_timeline(tracker, ax=None, title: str = "live tensor bytes during one step"):
    """A :class:`~minifsdp.memory.MemoryTracker`'s bytes over time, a dashed line at each mark.

    Returns the matplotlib Figure; the peak is the dot.
    """
    import matplotlib.pyplot as plt

    if not tracker.timeline:
        raise ValueError("the tracker has no timeline: plot it after its `with` block has run.")
    if ax is None:
        fig, ax = plt.subplots(figsize=(7, 3))
    else:
        fig = ax.figure
    t = [s * 1e3 for s, _ in tracker.timeline]
    kib = [b / 1024 for _, b in tracker.timeline]
    ax.step(t, kib, where="post", color="C0")
    i = kib.index(max(kib))
    ax.plot([t[i]], [kib[i]], "o", color="C3", label=f"peak {kib[i]:.0f} KiB ({tracker.peak_phase})")
    for name, s in tracker.marks:
        ax.axvline(s * 1e3, color="gray", linestyle="--", linewidth=0.8)
        ax.annotate(name, (s * 1e3, max(kib)), fontsize="small", rotation=90, va="top")
    ax.set_xlabel("ms since the tracker started")
    ax.set_ylabel("KiB")
    ax.set_title(title)
    ax.legend(fontsize="small")
    return fig
