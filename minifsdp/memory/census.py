"""Chapter 2.3: a census of every live tensor, the second witness beside the tracker.

:class:`~minifsdp.memory.tracker.MemoryTracker` keeps a running count: it
starts from what exists, then adds and subtracts as ops make tensors and
storages die.  A running count can drift: one missed allocation, and every
number after it is wrong.  A *census* does not run; it looks once, now:

    gc.get_objects()           every object Python's garbage collector tracks
      |  keep the tensors        (nn.Parameter, FlatParameter, DTensor's inner
      |  and bare storages        tensor, a tensor hidden in a closure, ...)
      v
    tensor.untyped_storage()   where its bytes live (views share their base's)
      |  count each storage once, by its address (data_ptr); skip 0-byte
      v  storages (FSDP's freed all-gather buffers) and other devices' (meta)
    sum of nbytes

It is independent of the tracker: no dispatch mode, no hooks, no weak
references, no events, no categories, and it dedups by address where the
tracker dedups by storage object.  If the tracker's total and the census agree
at rest, the tracker's bookkeeping over the step (every allocation, resize and
free) added up.  The tracker borrows this module's walk (``live_tensor_objects``,
``storages_of``) when it starts, to find what already exists (only *that*
agreement is by construction), and when it ends, as an audit that must find
nothing the running count missed (``found_at_exit == 0``).

Note (what a census cannot see, and neither can the tracker): bytes with no
Python object at all.  Tensors that live only in C++ (DDP's reducer buckets
unless ``gradient_as_bucket_view=True``; gloo's internal copies), the
allocator's caches and freed-but-kept pages, memory inside one kernel.  Those
show up in the process's resident set size (:func:`rss_bytes`), a third witness
that sees everything but cannot say whose it is (it also counts the
interpreter, libtorch's code, and freed memory malloc has not returned).

    live_tensor_bytes()        -> int, bytes of every live storage on "cpu"
    live_storages()            -> {data_ptr: nbytes}
    rss_bytes()                -> the process's resident set size now
    return_freed_memory()      -> ask malloc to give freed pages back (glibc)
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import os
from typing import Iterator

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

__all__ = ["live_tensor_bytes", "live_storages", "live_tensor_objects", "storages_of", "rss_bytes",
           "return_freed_memory"]

_TENSOR_TYPES = (torch._C.TensorBase, torch.UntypedStorage)


def live_tensor_objects(collect: bool = True) -> Iterator[torch.Tensor | torch.UntypedStorage]:
    """Every tensor and bare ``UntypedStorage`` Python can reach now (in no particular order).

    ``collect=True`` runs the garbage collector first, so that tensors held only
    by unreachable reference cycles (freed at the next collection anyway) are
    not counted.  We test ``issubclass(type(obj), ...)`` and not
    ``isinstance``: ``isinstance`` may ask an object for its ``__class__``, which
    some objects (deprecated module attributes) answer with a warning.
    """
    if collect:
        gc.collect()
    for obj in gc.get_objects():
        if issubclass(type(obj), _TENSOR_TYPES):
            yield obj


def storages_of(obj) -> list[torch.UntypedStorage]:
    """The storages that hold a tensor's (or a storage's) bytes; a wrapper subclass (DTensor) has none of
    its own, its inner tensors hold them."""
    if isinstance(obj, torch.UntypedStorage):
        return [obj]
    if is_traceable_wrapper_subclass(obj):
        names, _ = obj.__tensor_flatten__()
        inner = (getattr(obj, n) for n in names)
        return [s for t in inner if isinstance(t, torch.Tensor) for s in storages_of(t)]
    try:
        return [obj.untyped_storage()]
    except (RuntimeError, NotImplementedError):  # sparse and other layouts without one storage
        return []


def live_storages(device: str = "cpu", collect: bool = True) -> dict[int, int]:
    """``{address: bytes}`` for every live storage on ``device``; each storage once, 0-byte ones skipped."""
    device_type = torch.device(device).type
    out: dict[int, int] = {}
    for obj in live_tensor_objects(collect):
        for st in storages_of(obj):
            if st.device.type != device_type:  # meta (FakeTensor too), or another device
                continue
            nbytes = st.nbytes()
            if nbytes:
                ptr = st.data_ptr()
                out[ptr] = max(out.get(ptr, 0), nbytes)
    return out


def live_tensor_bytes(device: str = "cpu", collect: bool = True) -> int:
    """Bytes of every live tensor storage in this process on ``device``, each storage counted once.

    The independent count the tracker's total must equal at rest.  It costs one
    pass over every Python object (about 0.1 s with torch imported on a laptop),
    so it is a snapshot to take between steps, not inside every op.
    """
    return sum(live_storages(device, collect).values())


def rss_bytes() -> int:
    """The process's resident set size (bytes of RAM it occupies now), from ``/proc/self/statm``.

    Linux only; elsewhere falls back to the peak RSS from ``resource`` (which only grows).
    """
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        import resource  # not on Windows; /proc is missing on macOS

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def return_freed_memory() -> bool:
    """Ask glibc's malloc to hand freed pages back to the OS (``malloc_trim(0)``); False where there is none.

    Without it, memory a program freed may stay in its RSS (malloc keeps it for
    reuse), so an RSS *change* would read wrong: the next allocation reuses pages
    already counted.  Call it (after ``gc.collect()``) before an RSS baseline.
    For the RSS to follow the live tensors *during* a run, start the process with
    ``MALLOC_MMAP_THRESHOLD_=65536`` too: then every block of 64 KiB or more is
    unmapped when freed (by default glibc raises that threshold up to 32 MiB as
    such blocks are freed, and keeps the freed ones).
    """
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        return bool(libc is not None and libc.malloc_trim(0) is not None)
    except (OSError, AttributeError):  # musl, macOS: no malloc_trim
        return False
