"""Chapter 5 (FSDP2's per-parameter sharding): FSDP1's flat shard of a parameter beside FSDP2's rows of it.

The learner types a parameter's shape and picks N; the explorer shards it both ways, with the library's rules:

    FSDP1   the unit's parameters flattened into one vector, padded at its end to a multiple of N, rank r keeping
            the r-th 1/N of the numbers (``build_layout``, as torch FSDP1's ``FlatParamHandle``): a slice may
            start and end inside a row, and all the padding (at most N-1 numbers) is on the last ranks.
    FSDP2   the parameter cut along dim 0 into N chunks of ceil(d0 / N) rows (``chunk_rows`` /
            ``local_row_range``, as torch's ``Shard(0)`` does it with ``torch.chunk``): each rank keeps whole rows,
            a short last chunk is padded with zero rows, and a rank past the last row keeps none.

    shape (5, 4) at N = 2     FSDP1: rank 0 numbers [0, 10) = row 0 .. row 2 col 1;  rank 1 [10, 20)
                              FSDP2: rank 0 rows [0, 3);  rank 1 rows [3, 5) + 1 padding row (4 numbers)

The panel prints both per rank and draws them with ``minifsdp.pictures.fsdp2_plots.plot_layouts``.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch
import torch.nn as nn

from minifsdp.explorers.panel import live_panel, static_view, with_kernel_line
from minifsdp.explorers.panel import show as show_panel
from minifsdp.fsdp.core.flat_param import build_layout
from minifsdp.fsdp2.core.param import chunk_rows, local_row_range
from minifsdp.pictures.fsdp2_plots import plot_layouts

__all__ = ["DEFAULT", "FlatSlice", "RowChunk", "FlatVsRows", "parse_shape", "compute", "format_view", "fallback",
           "panel", "show"]

DEFAULT = {"shape": "96, 32", "world_size": 5}


@dataclass(frozen=True)
class FlatSlice:
    """FSDP1: rank's numbers ``[start, end)`` of the padded flat vector; ``padding`` of them are zeros."""
    start: int
    end: int
    padding: int


@dataclass(frozen=True)
class RowChunk:
    """FSDP2: rank's rows ``[start, end)`` of dim 0, padded with ``padding_rows`` zero rows to the chunk size."""
    start: int
    end: int
    padding_rows: int
    local_shape: tuple[int, ...]  # what ``to_local()`` gives: the rows the rank owns, no padding


@dataclass(frozen=True)
class FlatVsRows:
    """What ``compute`` returns."""
    shape: tuple[int, ...]
    world_size: int
    flat: list[FlatSlice]
    rows: list[RowChunk]
    chunk: int  # rows per rank's padded chunk, ceil(d0 / N)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def row_numel(self) -> int:
        return math.prod(self.shape[1:])

    @property
    def flat_padding(self) -> int:
        return sum(s.padding for s in self.flat)

    @property
    def rows_padding(self) -> int:
        return sum(c.padding_rows for c in self.rows) * self.row_numel


def parse_shape(text) -> tuple[int, ...]:
    """``"96, 32"``, ``"96x32"``, ``(96, 32)`` -> ``(96, 32)``: one or more positive whole numbers."""
    if isinstance(text, (tuple, list, torch.Size)):
        parts = [str(x) for x in text]
    else:
        parts = [p for p in re.split(r"[\s,x×()\[\]]+", str(text)) if p]
    if not parts or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise ValueError(f"a shape is positive whole numbers such as '96, 32'; got {text!r}")
    return tuple(int(p) for p in parts)


def compute(setting: dict | None = None) -> FlatVsRows:
    """Both layouts of one parameter (``setting``: ``shape`` and ``world_size``, defaults :data:`DEFAULT`)."""
    s = {**DEFAULT, **(setting or {})}
    shape, n = parse_shape(s["shape"]), int(s["world_size"])
    if not 1 <= n <= 64:
        raise ValueError(f"N must be 1 to 64, got {n}")
    holder = nn.Module()
    holder.weight = nn.Parameter(torch.empty(shape, device="meta"))  # build_layout reads shapes only
    layout = build_layout(holder, [holder.weight], n)
    flat = []
    for r in range(n):
        lo, hi = layout.shard_range(r)
        flat.append(FlatSlice(lo, hi, max(0, hi - max(lo, layout.numel))))
    rest = shape[1:]
    rows = []
    for r in range(n):
        a, b = local_row_range(shape[0], n, r)
        rows.append(RowChunk(a, b, chunk_rows(shape[0], n) - (b - a), (b - a, *rest)))
    return FlatVsRows(shape, n, flat, rows, chunk_rows(shape[0], n))


def _where(view: FlatVsRows, index: int) -> str:
    """A flat index as the element it is: ``row 2 col 1`` (1-D: ``[7]``)."""
    if len(view.shape) == 1:
        return f"[{index}]"
    row, col = divmod(index, view.row_numel)
    return f"row {row}" + (f" col {col}" if col else "")


def format_view(view: FlatVsRows) -> str:
    """Both layouts per rank, and the padding each design adds."""
    n, shape = view.world_size, view.shape
    lines = [f"a parameter of shape {shape} = {view.numel:,} numbers, N = {n}",
             f"FSDP1 (flat, padded to {view.flat[-1].end:,}): {view.flat[0].end - view.flat[0].start:,} numbers per "
             f"rank, {view.flat_padding:,} of padding at the end",
             f"FSDP2 (rows of dim 0, ceil({shape[0]}/{n}) = {view.chunk} per rank): "
             f"{view.rows_padding:,} numbers of padding ({view.rows_padding // view.row_numel} padding rows)",
             f"{'rank':<5}{'FSDP1 flat slice':<48}{'pad':>5}   {'FSDP2 rows':<14}{'local shape':<16}{'pad rows':>8}"]
    for r, (f, c) in enumerate(zip(view.flat, view.rows, strict=True)):
        held = min(f.end, view.numel) - f.start
        where = (f"[{f.start:,}, {f.end:,}) = {_where(view, f.start)} .. {_where(view, f.start + held - 1)}"
                 if held > 0 else f"[{f.start:,}, {f.end:,}) = padding only")
        rows = f"[{c.start}, {c.end})" if c.end > c.start else "none"
        lines.append(f"{r:<5}{where:<48}{f.padding:>5}   {rows:<14}{str(c.local_shape):<16}{c.padding_rows:>8}")
    return "\n".join(lines)


def fallback(setting: dict | None = None) -> str:
    """Print (and return) one setting's text and the line saying the panel needs a running kernel."""
    return static_view(format_view(compute(setting)))


def panel():
    """A text box for the shape and a slider for N; both layouts per rank, and the picture."""
    import ipywidgets as widgets
    import matplotlib.pyplot as plt

    controls = {"shape": widgets.Text(value=DEFAULT["shape"], description="shape", continuous_update=False),
                "world_size": widgets.IntSlider(value=DEFAULT["world_size"], min=1, max=8, description="N")}

    def draw(setting: dict) -> None:
        view = compute(setting)
        print(format_view(view))
        fig, ax = plt.subplots(figsize=(9, 1.2 + 0.9 * view.world_size))
        plot_layouts([("weight", torch.Size(view.shape))], view.world_size, ax=ax,
                     title=f"shape {view.shape} at N = {view.world_size}")
        fig.tight_layout()
        plt.show()
        plt.close(fig)

    return live_panel(controls, draw, "Chapter 5: FSDP1's flat shard beside FSDP2's rows")


def show(setting: dict | None = None) -> None:
    """A notebook cell's call: the panel in a running kernel; the fallback text on a page without one."""
    show_panel(panel, with_kernel_line(format_view(compute(setting))))
