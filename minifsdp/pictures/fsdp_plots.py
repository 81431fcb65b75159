"""Pictures for chapter 2 (FSDP): shard layouts, the collectives of a step, memory bars.

Three questions a reader of chapter 2 asks, and the picture that answers each:

* *Which numbers does my rank hold?*  :func:`plot_flat_layout` draws a unit's
  flat parameter (``minifsdp.fsdp.core.flat_param``) cut into N shards, coloured by the
  original parameter each element came from, padding hatched:

      flat:    [ weight ......... | bias .. | pad ]
      rank 0:  [ weight ....  ]
      rank 1:                [ .. | bias .. | pad ]

* *Which collectives run, in what order?*  :class:`CollectiveTracer` records
  every all-gather, reduce-scatter and all-reduce a step issues, with the FSDP
  unit it belongs to; :func:`plot_collective_sequence` draws them in order:

      forward:   AG root  AG blocks.0  AG blocks.1
      backward:  AG blocks.1  RS blocks.1  AG blocks.0  RS blocks.0  RS root

* *Where do the bytes go?*  :func:`plot_memory_bars` stacks a
  ``MemoryTracker`` breakdown (parameters, gradients, optimizer state, ...)
  per setup, optionally with the ZeRO formula as a marker.

How the tracer sees collectives without patching anything: since torch 2.0 the
process-group calls (``all_gather_into_tensor`` ...) go through the dispatcher
as ``c10d.*`` ops, so a ``TorchDispatchMode`` sees each one with its tensors.
An all-gather is matched to its unit by its output *storage* (the unit's
padded full buffer).  A reduce-scatter or all-reduce is attributed to the unit
whose gradient became ready last: a gradient hook on each unit's unsharded
flat parameter runs just before FSDP's post-backward hook issues the
reduction.  Our ring collectives (``collectives="ring"``) are many
point-to-point messages, not one op: trace with ``collectives="torch"`` and
count ring bytes with ``minifsdp.comm.collectives.count_bytes``.

Note: the tracer reads our units' ``_handle`` (the flat-parameter handle);
for torch's FSDP1 (or any model) it still records kind and size, with
``unit=None``.  Every function returns a matplotlib ``Figure``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

from minifsdp.checkpoint.pieces import module_names
from minifsdp.fsdp.core.units import units

__all__ = [
    "CollectiveEvent", "CollectiveTracer", "format_events", "plot_collective_sequence",
    "plot_flat_layout", "plot_memory_bars", "unit_names",
]

# c10d op name (as the dispatcher spells it) -> what the book calls it
_KINDS = {
    "_allgather_base_": "all_gather", "allgather_into_tensor_coalesced_": "all_gather",
    "allgather_": "all_gather", "_reduce_scatter_base_": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter", "reduce_scatter_": "reduce_scatter",
    "allreduce_": "all_reduce", "allreduce_coalesced_": "all_reduce",
}
SHORT = {"all_gather": "AG", "reduce_scatter": "RS", "all_reduce": "AR"}
COLORS = {"all_gather": "C0", "reduce_scatter": "C1", "all_reduce": "C2"}


@dataclass(frozen=True)
class CollectiveEvent:
    """One collective call: its kind, the phase it ran in, the unit, and the full (unsharded) size."""

    index: int
    kind: str  # "all_gather" | "reduce_scatter" | "all_reduce"
    phase: str  # the last name given to CollectiveTracer.mark()
    unit: str | None  # "root", "blocks.0", ... (None: could not tell)
    numel: int  # elements of the full tensor (all-gather output, reduce-scatter input)
    nbytes: int


def unit_names(model: nn.Module) -> dict[nn.Module, str]:
    """Our FSDP units of ``model`` -> a short name ("root", "blocks.0", ...)."""
    names = module_names(model)
    return {u: names[id(u)] or "root" for u in units(model)}


class _Spy(TorchDispatchMode):
    def __init__(self, tracer: "CollectiveTracer"):
        super().__init__()
        self.tracer = tracer

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "c10d":
            kind = _KINDS.get(func._opname)
            if kind is not None:
                self.tracer._record(kind, args)
        return func(*args, **kwargs)


class CollectiveTracer:
    """Record the collectives issued inside a ``with`` block, in order.

        tracer = CollectiveTracer(model)
        with tracer:
            tracer.mark("forward");  loss = model(x, y)
            tracer.mark("backward"); loss.backward()
        tracer.events   # [CollectiveEvent(...), ...]

    Only one rank needs to look (every rank issues the same sequence).
    """

    def __init__(self, model: nn.Module | None = None):
        self.model = model
        self.events: list[CollectiveEvent] = []
        self._phase = ""
        self._grad_ready: str | None = None
        self._by_storage: dict[int, str] = {}
        self._hooks: list = []
        self._spy: _Spy | None = None

    def mark(self, phase: str) -> None:
        """Name the phase that the next collectives belong to ("forward", "backward", ...)."""
        self._phase = phase

    def __enter__(self) -> "CollectiveTracer":
        if self.model is not None:
            for unit, name in unit_names(self.model).items():
                h = unit._handle
                if h is None:
                    continue
                if h.sharded:
                    self._by_storage[h.padded.untyped_storage()._cdata] = name  # stable across resize_
                if h.unsharded.requires_grad:
                    self._hooks.append(h.unsharded.register_hook(self._ready(name)))
        self._spy = _Spy(self)
        self._spy.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._spy.__exit__(*exc)
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    def _ready(self, name: str):
        def hook(grad):
            self._grad_ready = name  # FSDP's post-backward for this unit runs next
            return None

        return hook

    def _record(self, kind: str, args) -> None:
        # The full side (AG output, RS input) is the biggest argument; list forms hold one tensor per rank.
        full = max((list(_tensors(a)) for a in args), key=lambda ts: sum(t.numel() for t in ts))
        numel, nbytes = sum(t.numel() for t in full), sum(t.numel() * t.element_size() for t in full)
        if kind == "all_gather":
            unit = self._by_storage.get(full[0].untyped_storage()._cdata, None)  # the unit's padded buffer
        else:
            unit = self._grad_ready
        self.events.append(CollectiveEvent(len(self.events), kind, self._phase, unit, numel, nbytes))


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)


def format_events(events: Sequence[CollectiveEvent]) -> str:
    """One line per phase: ``forward: AG root, AG blocks.0, ...``."""
    lines: list[str] = []
    phase = None
    for e in events:
        if e.phase != phase:
            phase = e.phase
            lines.append(f"{phase or '(no phase)'}:")
        lines[-1] += f" {SHORT[e.kind]} {e.unit or '?'} ({e.numel});"
    return "\n".join(line.rstrip(";") for line in lines)


def plot_collective_sequence(events: Sequence[CollectiveEvent], ax=None, title: str = "collectives in one step"):
    """Each collective as a box, in issue order (x), on its unit's row (y); phases shaded."""
    import matplotlib.pyplot as plt

    if not events:
        raise ValueError("no collectives recorded: trace a step inside `with CollectiveTracer(model):`")
    units = list(dict.fromkeys(e.unit or "?" for e in events))
    if ax is None:
        fig, ax = plt.subplots(figsize=(max(6, 0.55 * len(events) + 2), 0.5 * len(units) + 1.6))
    else:
        fig = ax.figure
    start = 0
    for i, e in enumerate(list(events) + [None]):
        if e is None or e.phase != events[start].phase:
            ax.axvspan(start - 0.5, i - 0.5, color="0.85" if events[start].phase == "backward" else "0.94", zorder=0)
            ax.text((start + i - 1) / 2, -0.75, events[start].phase, ha="center", va="center", fontsize="small")
            start = i
    for e in events:
        y = units.index(e.unit or "?")
        ax.add_patch(plt.Rectangle((e.index - 0.4, y - 0.35), 0.8, 0.7, color=COLORS[e.kind]))
        ax.text(e.index, y, SHORT[e.kind], ha="center", va="center", color="white", fontsize="small")
    ax.set_xlim(-0.6, len(events) - 0.4)
    ax.set_ylim(len(units) - 0.4, -1.1)  # first unit on top, a band above it for the phase names
    ax.set_yticks(range(len(units)), units)
    ax.set_xticks(range(len(events)))
    ax.set_xlabel("order of issue")
    ax.set_title(title)
    kinds = [k for k in COLORS if any(e.kind == k for e in events)]
    ax.legend([plt.Rectangle((0, 0), 1, 1, color=COLORS[k]) for k in kinds], [k.replace("_", "-") for k in kinds],
              fontsize="small", loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    return fig


def plot_flat_layout(layout, ax=None, title: str | None = None, max_labels: int = 30):
    """A unit's flat parameter (top row) and each rank's shard (one row per rank), coloured by parameter.

    ``layout`` is a :class:`minifsdp.fsdp.core.flat_param.FlatParamLayout` (``build_layout(module, params, N)``).
    Padding is hatched grey; dashed lines are the shard boundaries.
    """
    import matplotlib.pyplot as plt

    n = layout.world_size
    if ax is None:
        fig, ax = plt.subplots(figsize=(10, 0.55 * (n + 1) + 1.6))
    else:
        fig = ax.figure
    cmap = plt.get_cmap("tab20")
    rows = [("flat", 0, layout.padded_numel)] + [(f"rank {r}", *layout.shard_range(r)) for r in range(n)]
    for y, (_, lo, hi) in enumerate(rows):
        for i, s in enumerate(layout.slots):
            a, b = max(lo, s.offset), min(hi, s.offset + s.numel)
            if a < b:
                ax.barh(y, b - a, left=a, height=0.7, color=cmap(i % 20), edgecolor="white", linewidth=0.3)
                if y == 0 and len(layout.slots) <= max_labels and (b - a) > 0.04 * layout.padded_numel:
                    ax.text((a + b) / 2, y, ".".join(s.fqn.split(".")[-2:]), ha="center", va="center", fontsize=7)
        if layout.padded_numel > layout.numel:
            a, b = max(lo, layout.numel), hi
            if a < b:
                ax.barh(y, b - a, left=a, height=0.7, color="0.85", hatch="///", edgecolor="0.5")
    for r in range(1, n):
        ax.axvline(r * layout.shard_numel, color="k", linestyle="--", linewidth=0.8)
    ax.set_yticks(range(len(rows)), [name for name, _, _ in rows])
    ax.invert_yaxis()
    ax.set_xlim(0, layout.padded_numel)
    ax.set_xlabel("element index in the flat parameter")
    pad = layout.padded_numel - layout.numel
    ax.set_title(title or f"{len(layout.slots)} parameters, {layout.numel} elements, N = {n}: "
                          f"{layout.shard_numel} per rank, {pad} padding")
    fig.tight_layout()
    return fig


CATEGORY_ORDER = ("parameters", "gradients", "optimizer_state", "buffers", "unsharded_parameters", "activations",
                  "other")


def plot_memory_bars(breakdowns: Mapping[str, Mapping[str, float]], ax=None, formula: Mapping[str, float] | None = None,
                     title: str = "bytes per rank at the peak"):
    """Stacked bars, one per setup, of a ``MemoryTracker`` breakdown (KiB); ``formula`` adds black markers.

    ``breakdowns``: {label: {category: bytes}} (a ``"total"`` key is ignored);
    ``formula``: {label: bytes} (for example the ZeRO model-state total).
    """
    import matplotlib.pyplot as plt

    labels = list(breakdowns)
    if ax is None:
        fig, ax = plt.subplots(figsize=(max(5, 1.1 * len(labels) + 2), 4))
    else:
        fig = ax.figure
    bottom = [0.0] * len(labels)
    for i, cat in enumerate(CATEGORY_ORDER):
        vals = [breakdowns[lab].get(cat, 0) / 1024 for lab in labels]
        if any(vals):
            ax.bar(range(len(labels)), vals, bottom=bottom, color=f"C{i}", label=cat.replace("_", " "))
            bottom = [b + v for b, v in zip(bottom, vals)]
    formula_max = max(formula.values()) if formula else 0
    if formula:
        xs = [i for i, lab in enumerate(labels) if lab in formula]
        ax.plot(xs, [formula[labels[i]] / 1024 for i in xs], "k_", markersize=28, mew=2,
                label="ZeRO formula (model state)")
    ax.set_xticks(range(len(labels)), labels, rotation=30, ha="right", fontsize="small")
    ax.set_ylabel("KiB per rank")
    ax.set_title(title)
    ax.set_ylim(0, 1.4 * max(bottom + [formula_max / 1024 if formula else 0]))  # headroom for the legend
    ax.legend(fontsize="x-small", loc="upper center", ncol=3, framealpha=0.95)
    fig.tight_layout()
    return fig
