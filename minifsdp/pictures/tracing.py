"""A per-rank timeline of one FSDP step: when each collective is issued, waited for, and computed around.

    with Tracer(model) as tr:            # attach to every FSDP unit; detached on exit
        model(x, y).backward()
    tr.exposed_seconds()                 # {"all-gather": s, "reduce-scatter": s}: time compute waited
    tr.plot(ax)                          # a Gantt chart (matplotlib)
    tr.export_chrome_trace("rank0.json") # open in https://ui.perfetto.dev or chrome://tracing

Events (times in seconds since the tracer started):

    all-gather issued      instant   the unit's all-gather was started (prefetch=True if ahead of need)
    all-gather wait        span      the compute thread blocked until the all-gather finished
    forward / backward     span      the unit's compute (nested units' spans lie inside their parent's)
    reduce-scatter issued  instant   the gradient's reduction was started
    reduce-scatter wait    span      blocked on it (in the next unit's post-backward, or the root's
                                     final callback for the last unit)

The core knows nothing of tracers.  Attached, a tracer joins every unit as an extension
(``minifsdp/fsdp/core/extension.py``: the compute spans open at ``after_unshard`` and close at
``after_reshard``; ``before_unshard`` says whether the next all-gather is a prefetch, and a unit whose
views a forward prefetch made starts computing when its forward has waited for that all-gather) and wraps
the unit's collectives (``handle.comm``), whose calls and waits are the other events.  Every
span is also a ``torch.profiler.record_function`` range, so the same names appear in a
``torch.profiler`` trace next to gloo's own ops (:func:`profile_to_chrome_trace`).

Note (exposed communication): a wait span is exactly the time the compute could
not proceed because of a collective.  An all-gather issued early (prefetch)
that finished while the previous unit computed has a near-zero wait.
"""

from __future__ import annotations

import contextlib
import json
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from minifsdp.fsdp.core.extension import Extension
from minifsdp.fsdp.core.fsdp import TrainingState
from minifsdp.fsdp.core.handle import HandleState
from minifsdp.fsdp.core.units import units

__all__ = ["Tracer", "profile_to_chrome_trace"]

COLORS = {"forward": "tab:blue", "backward": "tab:green", "all-gather wait": "tab:red",
          "reduce-scatter wait": "tab:orange"}


@dataclass
class Event:
    kind: str
    unit: str
    start: float
    end: float | None = None  # None: an instant
    args: dict = field(default_factory=dict)


class Tracer:
    """Records this rank's events while attached to a model (``with Tracer(model):``)."""

    def __init__(self, model=None, rank: int | None = None):
        self.model = model
        self.events: list[Event] = []
        self.t0 = time.perf_counter()
        self._open: dict[tuple[str, str], tuple[float, object]] = {}
        if rank is None:
            rank = dist.get_rank() if dist.is_initialized() else 0
        self.rank = rank

    # ------------------------------------------------------------------ attach
    def __enter__(self) -> "Tracer":
        self._set(self)
        return self

    def __exit__(self, *exc) -> None:
        self._set(None)

    def _set(self, tracer) -> None:
        for unit in units(self.model):
            h = unit._handle
            if tracer is not None and h is not None:
                h.comm = _TracedComm(h.comm, self, h)
                unit._extensions.append(_Spans(self, h.comm))
            elif h is not None:
                unit._extensions[:] = [e for e in unit._extensions if not (isinstance(e, _Spans) and e.tracer is self)]
                while isinstance(h.comm, _TracedComm) and h.comm.tracer is self:
                    h.comm = h.comm.inner

    # ------------------------------------------------------------------ record
    def now(self) -> float:
        return time.perf_counter() - self.t0

    def instant(self, kind: str, unit: str, **args) -> None:
        self.events.append(Event(kind, unit, self.now(), None, args))

    def open(self, kind: str, unit: str) -> None:
        rf = torch.profiler.record_function(f"minifsdp {kind} {unit}")
        rf.__enter__()
        self._open[(kind, unit)] = (self.now(), rf)

    @contextlib.contextmanager
    def span(self, kind: str, unit: str):
        """Record ``kind`` for ``unit`` from enter to exit (what the core's handle and unit call)."""
        self.open(kind, unit)
        try:
            yield
        finally:
            self.close(kind, unit)

    def close(self, kind: str, unit: str) -> None:
        if (kind, unit) not in self._open:
            return
        start, rf = self._open.pop((kind, unit))
        rf.__exit__(None, None, None)
        self.events.append(Event(kind, unit, start, self.now()))

    # ------------------------------------------------------------------ read
    def spans(self, kind: str) -> list[Event]:
        return [e for e in self.events if e.kind == kind and e.end is not None]

    def exposed_seconds(self) -> dict[str, float]:
        """Seconds the compute thread waited on each kind of collective."""
        return {c: sum(e.end - e.start for e in self.spans(f"{c} wait")) for c in ("all-gather", "reduce-scatter")}

    def plot(self, ax=None, title: str | None = None):
        """Gantt chart: one row per unit; compute bars, waits (exposed communication) in red/orange."""
        import matplotlib.pyplot as plt

        ax = ax or plt.subplots(figsize=(10, 3))[1]
        units = list(dict.fromkeys(e.unit for e in self.events))
        for e in self.events:
            y = units.index(e.unit)
            if e.end is None:
                marker = "v" if e.args.get("prefetch") else "|"
                ax.plot([e.start * 1e3], [y + 0.4], marker, color="tab:red" if "gather" in e.kind else "tab:orange")
                continue
            inset = 0.15 if "wait" in e.kind else 0.0
            ax.barh(y, (e.end - e.start) * 1e3, left=e.start * 1e3, height=0.6 - inset,
                    color=COLORS.get(e.kind, "gray"), alpha=0.8)
        ax.set_yticks(range(len(units)), units)
        ax.set_xlabel("ms")
        ax.set_title(title or f"rank {self.rank}: compute (blue fwd, green bwd), waits on all-gather (red) / "
                     "reduce-scatter (orange); markers: issued (v = prefetch)", fontsize=8)
        return ax

    def export_chrome_trace(self, path: str) -> None:
        """Chrome trace-event JSON (one process per rank, one thread per unit)."""
        units = list(dict.fromkeys(e.unit for e in self.events))
        out = []
        for e in self.events:
            base = dict(name=e.kind, pid=self.rank, tid=units.index(e.unit), ts=e.start * 1e6, args=dict(e.args))
            base["args"]["unit"] = e.unit
            if e.end is None:
                out.append(dict(base, ph="i", s="t"))
            else:
                out.append(dict(base, ph="X", dur=(e.end - e.start) * 1e6))
        with open(path, "w") as f:
            json.dump({"traceEvents": out, "displayTimeUnit": "ms"}, f)


class _Spans(Extension):
    """The compute spans of one unit, at the step's fixed points (``core/extension.py``)."""

    def __init__(self, tracer: Tracer, comm: "_TracedComm"):
        self.tracer, self.comm = tracer, comm

    def before_unshard(self, unit, prefetch: bool) -> None:
        self.comm.prefetch = prefetch  # for the all-gather this unshard may issue

    def after_unshard(self, unit) -> None:
        kind = _KIND.get(unit.training_state)
        if kind == "forward" and self.comm.prefetch:  # a forward prefetch made the views: the unit computes
            if unit._handle.state is HandleState.GATHERING:  # once its own forward has waited for the gather
                self.comm.last_gather.then = lambda: self.tracer.open(kind, unit._handle.name)
        elif kind is not None:
            self.tracer.open(kind, unit._handle.name)

    def after_reshard(self, unit) -> None:
        kind = {TrainingState.FORWARD: "forward", TrainingState.POST_BACKWARD: "backward"}.get(unit.training_state)
        if kind is not None:
            self.tracer.close(kind, unit._handle.name)


_KIND = {TrainingState.FORWARD: "forward", TrainingState.PRE_BACKWARD: "backward"}


class _TracedWork:
    def __init__(self, work, tracer: Tracer, kind: str, unit: str):
        self.work, self.tracer, self.kind, self.unit = work, tracer, kind, unit
        self.then = None  # what starts once the wait is over (a prefetched unit's forward span)

    def wait(self):
        with self.tracer.span(self.kind, self.unit):
            out = self.work.wait()
        if self.then is not None:
            self.then, then = None, self.then
            then()
        return out

    def __getattr__(self, name):
        return getattr(self.work, name)


class _TracedComm:
    """A unit's collectives, each call an "issued" instant and each wait a span: its all-gathers, and its
    gradient's reduction (reduce-scatter, or NO_SHARD's all-reduce in the unit's own group)."""

    def __init__(self, inner, tracer: Tracer, handle):
        self.inner, self.tracer, self.handle, self.prefetch = inner, tracer, handle, False
        self.last_gather: _TracedWork | None = None

    def _traced(self, what: str, collective, *args, **kwargs):
        extra = {"prefetch": self.prefetch} if what == "all-gather" else {}
        self.tracer.instant(f"{what} issued", self.handle.name, **extra)
        work = _TracedWork(collective(*args, **kwargs), self.tracer, f"{what} wait", self.handle.name)
        if what == "all-gather":
            self.last_gather = work
        return work

    def all_gather(self, *args, **kwargs):
        return self._traced("all-gather", self.inner.all_gather, *args, **kwargs)

    def reduce_scatter(self, *args, **kwargs):
        return self._traced("reduce-scatter", self.inner.reduce_scatter, *args, **kwargs)

    def all_reduce(self, *args, group=None, **kwargs):
        if group is not self.handle.groups.shard:  # (HYBRID's second all-reduce, across replicas: not traced)
            return self.inner.all_reduce(*args, group=group, **kwargs)
        return self._traced("reduce-scatter", self.inner.all_reduce, *args, group=group, **kwargs)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def profile_to_chrome_trace(step, path: str, steps: int = 1) -> None:
    """Run ``step()`` under ``torch.profiler`` and write its trace (our spans + torch's ops, gloo's included)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    prof.export_chrome_trace(path)
