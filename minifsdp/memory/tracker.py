"""Chapter 2.3: how many bytes does each rank hold, and what are they?

We measure memory from the tensors themselves, not from the process (RSS
counts the Python interpreter, freed-but-cached pages, gloo's buffers...).
Every byte a tensor owns lives in an *untyped storage*; several tensors (views,
tied weights, a FlatParameter and its views) may share one storage, so we count
storages, each once.

How :class:`MemoryTracker` sees every storage come and go:

    op runs (forward, backward, optimizer, collectives)
      |  TorchDispatchMode: after each aten op, look at the storages of its
      |  inputs and outputs; one we have not seen yet is new: count it
      v
    storage.resize_(n)   <-- NOT an aten op: torch FSDP1 and FSDP2 allocate and
      |                      free the all-gathered parameter this way, so we wrap
      |                      torch.UntypedStorage.resize_ while tracking
      v
    storage dies         <-- a weakref callback on the storage subtracts its bytes

Why not torch.profiler(profile_memory=True)?  It sees allocator events (resize
included) but only as addresses and sizes: it cannot say *whose* bytes they
are.  Why not only a dispatch mode?  ``resize_`` on a storage bypasses the
dispatcher: FSDP's all-gather buffer would be seen only when the next op
touches it (late), and its free not until something re-reads its size
(``test_tracker_sees_frees_and_storage_resizes`` shows a resize that no op sees).
This is also how torch's own ``torch.distributed._tools.mem_tracker`` works.

How each live storage gets its category (first match wins, in this order):

    parameters            storages of model.parameters() at __enter__/__exit__
                          (at rest: for FSDP these are the local shards)
    gradients             seen as some parameter's .grad
    optimizer_state       seen in optimizer.state (exp_avg, exp_avg_sq, step)
    buffers               model.buffers()
    unsharded_parameters  seen backing a parameter or a module's tensor attribute
                          *during* the step without being an at-rest parameter:
                          FSDP's all-gathered parameters (seen by forward
                          pre-hooks on every module and scans at each new peak)
    resident              alive at __enter__, reachable from Python, none of the
                          above: the batch, the dataset, another model, a copy of
                          the weights some object (closure, layout, cache) holds
    activations           saved for backward (a saved_tensors_hooks pack hook)
    other                 everything else: the loss, temporaries of the op
                          running now, comm buffers (FSDP2's all-gather output)

"resident" precedes "activations": a batch made before the region and saved
for backward is not a byte the step allocated.

Note (what is counted): every storage alive at __enter__ that Python can reach,
each once: the model's and optimizer's, and (a scan of every live Python object,
``census.live_tensor_objects``, after ``gc.collect()``) all others as "resident".
From then on a storage counts from when we first see it: an op's output or input
(``torch.from_numpy`` makes one with no op), resized, or shown by the model or
optimizer.  So the total at rest equals ``census.live_tensor_bytes()``, an
independent count (``tests/test_memory_census.py``: ours, torch FSDP1, FSDP2,
DDP), and a full copy of the weights that the model no longer points to cannot
hide.  Only storages on ``device`` count.

Note (when it scans everything): at __enter__ and __exit__, not at each new
peak: one scan walks every Python object (~165k with torch imported, ~0.1 s on a
laptop) and a step makes 30-50 new peaks, seconds per tracked step.  The exit scan
is an audit: live storages the op tracking missed (made on another thread, or by
no aten op) are added as "resident", their bytes in ``found_at_exit`` (0 when the
running count was right).  ``on_peak`` runs a witness of yours at each new peak.

Note (what it still cannot see): bytes with no Python object.  Tensors that
live only in C++ (autograd's saved tensors that never had a Python object, DDP's
reducer buckets unless ``gradient_as_bucket_view=True`` makes them the .grad,
gloo's internal copies), the allocator's caches, scratch memory inside one
kernel.  The process's RSS (``census.rss_bytes``) sees those, but not whose.
Nor the 8-byte tensor autograd saves for ``x / 4.0`` (the op gets a number, and
autograd saves it with no pack hook): the census sees it, 8 bytes above us.

    with MemoryTracker(model, optimizer) as mt:
        mt.mark("forward");  loss = model(x, y)
        mt.mark("backward"); loss.backward()
        mt.mark("step");     optimizer.step()
    mt.peak_bytes, mt.breakdown_at_peak, mt.breakdown_at("backward"), mt.timeline

Totals count everything alive, other models too: to compare setups, measure each
with only it alive, or subtract ``breakdown_at_peak["resident"]`` (what was alive
before and is not this model's or optimizer's): ``without_resident(breakdown)``.
"""

from __future__ import annotations

import functools
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

from minifsdp.memory.activation_sizes import tensors_in as _tensors_in
from minifsdp.memory.census import live_tensor_objects
from minifsdp.memory.census import storages_of as _storages  # a DTensor's bytes live in its local tensor

__all__ = ["MemoryTracker", "snapshot", "without_resident", "CATEGORIES"]

# in order of precedence: a storage seen in two roles gets the first
CATEGORIES = ("parameters", "gradients", "optimizer_state", "buffers", "unsharded_parameters", "resident",
              "activations", "other")


def without_resident(breakdown: dict[str, int]) -> dict[str, int]:
    """``breakdown`` less its "resident" bytes (other models, a dataset alive in the process), total too."""
    rest = {k: v for k, v in breakdown.items() if k != "resident"}
    return {**rest, "total": breakdown["total"] - breakdown.get("resident", 0)}


def _module_tensors(module: nn.Module) -> Iterator[torch.Tensor]:
    """A module's own parameters and plain tensor attributes (FSDP1 puts unsharded views there)."""
    yield from (p for p in module._parameters.values() if p is not None)
    yield from (v for v in vars(module).values() if isinstance(v, torch.Tensor))


def snapshot(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
    """Static per-rank bytes held by the model and optimizer right now, each storage counted once.

    Returns ``{"parameters", "gradients", "optimizer_state", "buffers", "total"}``
    in bytes.  Tied weights count once; a .grad that is a view into a DDP bucket
    counts the whole bucket.  Call it between steps (at rest).
    """
    groups = {
        "parameters": list(model.parameters()),
        "gradients": [p.grad for p in model.parameters() if p.grad is not None],
        "optimizer_state": list(_tensors_in(list(optimizer.state.values()))) if optimizer is not None else [],
        "buffers": list(model.buffers()),
    }
    seen: set[int] = set()
    out = {}
    for category, tensors in groups.items():
        out[category] = 0
        for t in tensors:
            for st in _storages(t):
                if id(st) not in seen:  # storages have one Python object each, so id() is identity
                    seen.add(id(st))
                    out[category] += st.nbytes()
    out["total"] = sum(out.values())
    return out


@dataclass
class _Entry:
    """What we know about one live storage."""

    key: int  # a serial number: id(storage) is reused after a storage dies, this is not
    nbytes: int
    roles: set[str] = field(default_factory=set)
    ref: Any = None  # the weakref whose callback tells us the storage died


class _OpSpy(TorchDispatchMode):
    """After every aten op, hand its inputs and outputs to the tracker."""

    def __init__(self, tracker: "MemoryTracker"):
        super().__init__()
        self.tracker = tracker

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # Everything Python reached at __enter__ is known, so a storage seen for the first time is new: an
        # output this op made, or an input no op made (torch.from_numpy, a C++-only tensor coming to light).
        # Known ones may have been resized (resize_, set_).
        for t in _tensors_in((args, kwargs, out)):
            self.tracker._see(t)
        return out


class MemoryTracker:
    """Live tensor bytes over one region of code, with a category for each byte at the peak.

    Args:
        model, optimizer: what to categorise against (either may be None).
        device: count only storages on this device type ("cpu").
        track_storage_resize: wrap ``torch.UntypedStorage.resize_`` (keep True;
            False exists to show what a plain dispatch mode misses).
        on_peak: called with no arguments at each new peak, inside the op that
            made it; its last result is ``on_peak_result`` (a witness at the
            same moment: a census, the RSS).  It must not make tensors.

    After the ``with`` block: ``peak_bytes``, ``breakdown_at_peak``, ``peak_phase``,
    ``breakdown_at(mark)``, ``timeline`` [(seconds, bytes)], ``marks`` [(name, seconds)],
    ``found_at_exit`` (bytes the exit scan found that the op tracking missed).
    The tracker lets go of ``model`` and ``optimizer`` at exit: an instrument
    must not keep alive what the next measurement would count.
    """

    _active: "MemoryTracker | None" = None

    def __init__(self, model=None, optimizer=None, device: str = "cpu", track_storage_resize: bool = True,
                 on_peak: Callable[[], Any] | None = None):
        self.model, self.optimizer, self.device = model, optimizer, torch.device(device).type
        self.track_storage_resize = track_storage_resize
        self.on_peak, self.on_peak_result = on_peak, None
        self.found_at_exit = 0
        self.timeline: list[tuple[float, int]] = []  # (seconds since enter, bytes alive)
        self.marks: list[tuple[str, float]] = []
        self.peak_bytes, self.peak_phase, self.current_bytes = 0, "", 0
        self.storage_resizes = 0  # calls to UntypedStorage.resize_ seen (FSDP's all-gather buffers)
        self._entries: dict[int, _Entry] = {}  # id(storage) -> entry, for live storages only
        self._serial = 0
        self._peak_live: dict[int, int] = {}  # entry key -> bytes, at the peak
        self._mark_live: dict[str, dict[int, int]] = {}
        self._dead_roles: dict[int, set[str]] = {}  # roles of storages freed inside the region
        self._phase, self._scanning = "start", False
        self._lock = threading.RLock()  # a storage may die on another thread (gloo's), mid-update here
        self._undo: list[Any] = []

    # ---- the region ----------------------------------------------------------------
    def __enter__(self) -> "MemoryTracker":
        if MemoryTracker._active is not None:
            raise RuntimeError("a MemoryTracker is already running; nest nothing, track one region at a time.")
        MemoryTracker._active = self
        self._t0 = time.perf_counter()
        self._scan(at_rest=True)  # what exists already: the model's and optimizer's tensors ...
        self._scan_resident()  # ... and every other storage Python can reach
        self.timeline.clear()  # the timeline starts from there
        self.peak_bytes = -1
        self._record()
        if self.track_storage_resize:
            original = torch.UntypedStorage.resize_

            @functools.wraps(original)
            def resize_(storage, size):
                result = original(storage, size)
                self.storage_resizes += 1
                self._see_storage(storage)
                return result

            torch.UntypedStorage.resize_ = resize_
            self._undo.append(lambda: setattr(torch.UntypedStorage, "resize_", original))
        if self.model is not None:
            for m in self.model.modules():
                h = m.register_forward_pre_hook(self._forward_pre_hook)
                self._undo.append(h.remove)
        saved = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        saved.__enter__()
        self._undo.append(lambda: saved.__exit__(None, None, None))
        spy = _OpSpy(self)
        spy.__enter__()
        self._undo.append(lambda: spy.__exit__(None, None, None))
        return self

    def __exit__(self, *exc) -> None:
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()
        MemoryTracker._active = None
        self._scan(at_rest=True)
        self.found_at_exit = self._scan_resident()
        if self.found_at_exit:
            self._record()  # what the exit scan found may make a new peak
        self.mark("end")
        # Resolve every storage we kept numbers for into one category, then forget the storages.
        with self._lock:
            entries, self._entries = list(self._entries.values()), {}
        self._final_roles = {e.key: e.roles for e in entries} | self._dead_roles
        for e in entries:
            e.ref = None
        self.model = self.optimizer = None

    def mark(self, name: str) -> None:
        """Start a phase called ``name`` ("forward", "backward", "step", ...) and remember the bytes now."""
        if not hasattr(self, "_t0"):
            raise RuntimeError("mark() belongs inside `with MemoryTracker(...) as mt:`; the tracker is not running.")
        self._scan(at_rest=False)
        self._phase = name
        self.marks.append((name, time.perf_counter() - self._t0))
        self._mark_live[name] = self._live()

    # ---- results -------------------------------------------------------------------
    @property
    def breakdown_at_peak(self) -> dict[str, int]:
        """Bytes per category at the peak; the values (without "total") add up to ``peak_bytes``."""
        return self._breakdown(self._peak_live)

    def breakdown_at(self, mark: str) -> dict[str, int]:
        """Bytes per category when ``mark(mark)`` was called ("end" is the end of the region)."""
        if mark not in self._mark_live:
            raise KeyError(f"no mark named {mark!r}; marks are {[m for m, _ in self.marks]}")
        return self._breakdown(self._mark_live[mark])

    def _breakdown(self, live: dict[int, int]) -> dict[str, int]:
        if not hasattr(self, "_final_roles"):
            raise RuntimeError("the breakdown is known once the `with MemoryTracker(...)` block has ended.")
        out = dict.fromkeys(CATEGORIES, 0)
        for key, nbytes in live.items():
            roles = self._final_roles.get(key, set())
            out[next((c for c in CATEGORIES if c in roles), "other")] += nbytes
        out["total"] = sum(live.values())
        return out

    # ---- seeing storages -----------------------------------------------------------
    def _see(self, t: torch.Tensor, role: str | None = None) -> None:
        for st in _storages(t):
            self._see_storage(st, role)

    def _see_storage(self, st: torch.UntypedStorage, role: str | None = None) -> None:
        """Count ``st`` (from now on, if it is new), label it with ``role``, notice a resize."""
        if MemoryTracker._active is not self or st.device.type != self.device:
            return
        with self._lock:
            self._count(st, role)

    def _count(self, st: torch.UntypedStorage, role: str | None) -> None:
        entry = self._entries.get(id(st))
        if entry is None:  # first sight: count it from now on
            self._serial += 1
            entry = _Entry(key=self._serial, nbytes=0)
            entry.ref = weakref.ref(st, functools.partial(self._on_free, id(st)))
            self._entries[id(st)] = entry
        if role is not None:
            entry.roles.add(role)
        if st.nbytes() != entry.nbytes:  # new, or resized
            self.current_bytes += st.nbytes() - entry.nbytes
            entry.nbytes = st.nbytes()
            self._record()

    def _on_free(self, storage_id: int, _ref) -> None:
        with self._lock:
            entry = self._entries.pop(storage_id, None)
            if entry is None or MemoryTracker._active is not self:
                return
            self._dead_roles[entry.key] = entry.roles  # dead storages may be in the peak's record
            self.current_bytes -= entry.nbytes
            if entry.nbytes:
                self._record()

    def _live(self) -> dict[int, int]:
        return {e.key: e.nbytes for e in list(self._entries.values()) if e.nbytes}  # list(): frees may land

    def _record(self) -> None:
        self.timeline.append((time.perf_counter() - self._t0, self.current_bytes))
        if self.current_bytes > self.peak_bytes and not self._scanning:
            self._scan(at_rest=False)  # label what is alive now (grads, unsharded params); may find frees
            if self.current_bytes > self.peak_bytes:
                self.peak_bytes = self.current_bytes
                self.peak_phase = self._phase
                self._peak_live = self._live()  # ... and keep it
                if self.on_peak is not None:
                    self._scanning = True  # frees inside the witness must not recurse into it
                    try:
                        self.on_peak_result = self.on_peak()
                    finally:
                        self._scanning = False

    def _scan(self, at_rest: bool) -> None:
        """Label the storages reachable from the model and optimizer now."""
        was_active, MemoryTracker._active = MemoryTracker._active, self  # scans at __exit__ still count
        self._scanning = True
        try:
            if self.model is not None:
                for p in self.model.parameters():
                    self._see(p, "parameters" if at_rest else "unsharded_parameters")
                    if p.grad is not None:
                        self._see(p.grad, "gradients")
                for b in self.model.buffers():
                    self._see(b, "buffers")
                if not at_rest:
                    for m in self.model.modules():
                        for t in _module_tensors(m):
                            self._see(t, "unsharded_parameters")
            if self.optimizer is not None:
                for t in _tensors_in(list(self.optimizer.state.values())):
                    self._see(t, "optimizer_state")
        finally:
            MemoryTracker._active = was_active
            self._scanning = False

    def _scan_resident(self) -> int:
        """Count each live storage Python reaches that we do not know as "resident"; return the bytes added.

        ``gc.collect()`` runs first (in ``live_tensor_objects``) while we are active: frees of cycles subtract.
        """
        was_active, MemoryTracker._active = MemoryTracker._active, self
        self._scanning, added = True, 0
        try:
            for obj in live_tensor_objects(collect=True):
                for st in _storages(obj):
                    if id(st) not in self._entries and st.nbytes() and st.device.type == self.device:
                        added += st.nbytes()
                        self._see_storage(st, "resident")
        finally:
            MemoryTracker._active = was_active
            self._scanning = False
        return added

    def _forward_pre_hook(self, module, args) -> None:
        for t in _module_tensors(module):
            self._see(t, "unsharded_parameters")

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        self._see(t, "activations")  # saved for backward (a batch made before the region stays "resident")
        return t
