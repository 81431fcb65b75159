"""Chapter 4.4 pictures: a pipeline's timeline (stages x time) and how tensor parallelism cuts two Linears.

* :func:`plot_pipeline_timeline` draws one row per stage and one box per forward (F) or backward (B) of a
  micro-batch, coloured by micro-batch (backwards hatched), from either source the pipeline module offers:

      simulate_timeline("1f1b", 4, 6)     unit-time slots: [[ "F0", "F1", ..., None, ...], ...] per stage
      [stage.events for each rank]        measured: [(action, start, end), ...] per stage, time.time() stamps

  Idle time (the bubble) is what is left white.
* :func:`plot_tp_layout` draws the weights of ``fc2(act(fc1(x)))`` under ``{"fc1": ColwiseParallel(),
  "fc2": RowwiseParallel()}``: fc1's rows and fc2's columns coloured by the rank that holds them, and where
  the one all-reduce of the forward (g) and of the backward (f) happen.

Plotting only (matplotlib); the numbers come from ``minifsdp.parallel``.
"""

from __future__ import annotations

import matplotlib.pyplot as plt
from matplotlib.patches import Patch, Rectangle

from minifsdp.parallel.pipeline_schedules import bubble_fraction

__all__ = ["timeline_boxes", "plot_pipeline_timeline", "plot_tp_layout"]


def timeline_boxes(timeline) -> list[list[tuple[str, float, float]]]:
    """Per stage, ``(action, start, end)`` boxes, from simulated slots or from recorded ``stage.events``.

    Slots (a list per stage of action names or None) become unit boxes ``(a, t, t + 1)``; events are shifted
    so that the earliest start anywhere is 0.
    """
    rows = [list(r) for r in timeline]
    if all(isinstance(a, str) or a is None for r in rows for a in r):
        return [[(a, float(t), float(t + 1)) for t, a in enumerate(r) if a is not None] for r in rows]
    t0 = min(e[1] for r in rows for e in r)
    return [[(a, s - t0, e - t0) for a, s, e in r] for r in rows]


def _busy_share(boxes) -> float:
    span = max(e for r in boxes for _, _, e in r) - min(s for r in boxes for _, s, _ in r)
    return sum(e - s for r in boxes for _, s, e in r) / (len(boxes) * span)


def plot_pipeline_timeline(timeline, ax=None, title: str = "", unit: str = "time slots"):
    """Draw a pipeline timeline (see the module docstring for the two inputs); returns the axes.

    The title gets the idle share of the drawing (1 - busy / (stages x span)) and, for simulated slots,
    the formula (S-1)/(M+S-1) beside it.
    """
    boxes = timeline_boxes(timeline)
    n_mb = 1 + max(int(a[1:]) for r in boxes for a, _, _ in r)
    colours = plt.get_cmap("tab10" if n_mb <= 10 else "tab20")
    if ax is None:
        _, ax = plt.subplots(figsize=(10, 0.6 * len(boxes) + 1))
    for s, row in enumerate(boxes):
        for a, start, end in row:
            m = int(a[1:])
            ax.add_patch(Rectangle((start, s - 0.4), end - start, 0.8, facecolor=colours(m % colours.N),
                                   edgecolor="black", linewidth=0.6, hatch="//" if a[0] == "B" else None,
                                   alpha=0.9 if a[0] == "F" else 0.6))
            ax.text((start + end) / 2, s, a, ha="center", va="center", fontsize=8)
    span = max(e for r in boxes for _, _, e in r)
    ax.set_xlim(0, span)
    ax.set_ylim(len(boxes) - 0.5, -0.5)
    ax.set_yticks(range(len(boxes)), [f"stage {s}" for s in range(len(boxes))])
    ax.set_xlabel(unit)
    idle = 1 - _busy_share(boxes)
    simulated = all(isinstance(a, str) or a is None for r in timeline for a in r)
    extra = f", formula (S-1)/(M+S-1) = {bubble_fraction(len(boxes), n_mb):.3f}" if simulated else ""
    ax.set_title(f"{title}  idle share {idle:.3f}{extra}".strip())
    ax.legend(handles=[Patch(facecolor="white", edgecolor="black", label="F: forward"),
                       Patch(facecolor="white", edgecolor="black", hatch="//", label="B: backward")],
              loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    return ax


def plot_tp_layout(in_features: int, hidden: int, out_features: int, world_size: int, ax=None):
    """Draw fc1 (hidden x in, cut by rows) and fc2 (out x hidden, cut by columns) coloured by rank; returns ax."""
    if ax is None:
        _, ax = plt.subplots(figsize=(10, 4))
    colours = plt.get_cmap("Set2")
    scale = 4.0 / max(in_features, hidden, out_features)
    w1, h1 = in_features * scale, hidden * scale  # fc1.weight: (hidden, in)
    w2, h2 = hidden * scale, out_features * scale  # fc2.weight: (out, hidden)
    x2 = w1 + 3.0
    for r in range(world_size):
        ax.add_patch(Rectangle((0, h1 - (r + 1) * h1 / world_size), w1, h1 / world_size,
                               facecolor=colours(r), edgecolor="black"))
        ax.text(w1 / 2, h1 - (r + 0.5) * h1 / world_size, f"rank {r}\nrows {r * hidden // world_size}:"
                f"{(r + 1) * hidden // world_size}", ha="center", va="center", fontsize=8)
        ax.add_patch(Rectangle((x2 + r * w2 / world_size, h1 - h2), w2 / world_size, h2,
                               facecolor=colours(r), edgecolor="black"))
        ax.text(x2 + (r + 0.5) * w2 / world_size, h1 - h2 / 2, f"rank {r}\ncols {r * hidden // world_size}:"
                f"{(r + 1) * hidden // world_size}", ha="center", va="center", fontsize=8)
    ax.text(w1 / 2, h1 + 0.3, f"fc1.weight ({hidden} x {in_features})\nColwiseParallel: Shard(0)",
            ha="center", va="bottom", fontsize=9)
    ax.text(x2 + w2 / 2, h1 + 0.3, f"fc2.weight ({out_features} x {hidden})\nRowwiseParallel: Shard(1)",
            ha="center", va="bottom", fontsize=9)
    ax.annotate("", xy=(x2 - 0.2, h1 / 2), xytext=(w1 + 0.2, h1 / 2), arrowprops={"arrowstyle": "->"})
    ax.text(w1 + 1.5, h1 / 2 + 0.15, f"(B, {hidden // world_size}) per rank\nno communication",
            ha="center", va="bottom", fontsize=8)
    ax.text(-0.3, h1 / 2, "x (B, in), whole\nf: backward\nall-reduce", ha="right", va="center", fontsize=8)
    ax.text(x2 + w2 + 0.3, h1 - h2 / 2, "g: forward\nall-reduce\n-> z (B, out), whole", ha="left", va="center",
            fontsize=8)
    ax.set_xlim(-2.5, x2 + w2 + 2.5)
    ax.set_ylim(-0.5, h1 + 1.5)
    ax.set_aspect("equal")
    ax.axis("off")
    return ax
