"""Chapter 2.2: once a collective is done, the collectives keep nothing of it -- checked in one process.

What a rank keeps between collectives is memory it holds while it trains: a census counts it, torch
does not hold it.  So once a collective has returned (or its ``wait()`` has), every tensor of the
caller's that the caller drops must be freed at once, and the comm streams may keep only the tuned
ring's header receives posted for the next collective (``minifsdp/comm/tuned/header.py``, the doorbells).

Instrument: the census of every live tensor storage in the process (``minifsdp.memory.census``), taken
before and after, every thread-rank waiting at a barrier; and weak references to the caller's tensors.
Exact: bytes, not timings.  The ranks are threads of this process (``tests/comm/_ring_threads.py``).
"""

from __future__ import annotations

import threading
import time
import weakref
from unittest import mock

import pytest
import torch
import torch.distributed as dist

from minifsdp.comm import collectives as C
from minifsdp.comm.stream import stream_for
from minifsdp.memory.census import live_storages
from tests.comm._ring_threads import run_ranks


def _posted_bytes(group) -> int:
    """Bytes of the header receives this rank's stream has posted for the next collective."""
    bells = stream_for(group).doorbells
    return sum(buf.untyped_storage().nbytes() for peer, bell in bells.items() if peer != "my_room"
               for _, buf, _ in bell["posted"])


def _collectives_then_drop(group, kind: str, barrier: threading.Barrier, census: dict) -> list[str]:
    """Every collective of ``kind``, sync then async, on fresh tensors the caller drops after; then rank 0
    compares the census with the one taken before (everyone waiting).  Returns what went wrong."""
    comm, n, fails = C.get_collectives(kind), group.size, []
    barrier.wait()
    if group.rank == 0:
        census["before"] = live_storages()
    barrier.wait()
    refs = []
    for async_op in (False, True):
        t, out_rs, in_rs, out_ag, in_ag = torch.ones(37), torch.empty(5), torch.ones(5 * n), torch.empty(5 * n), \
            torch.ones(5)
        refs += [weakref.ref(x) for x in (t, out_rs, in_rs, out_ag, in_ag)]
        works = [comm.all_reduce(t, group=group, async_op=async_op),
                 comm.reduce_scatter(out_rs, in_rs, group=group, async_op=async_op),
                 comm.all_gather(out_ag, in_ag, group=group, async_op=async_op)]
        for w in works:
            if w is not None:
                w.wait()
        if not (torch.equal(t, torch.full((37,), float(n))) and torch.equal(out_rs, torch.full((5,), float(n)))
                and torch.equal(out_ag, torch.ones(5 * n))):
            fails.append(f"rank {group.rank} async_op={async_op}: wrong results")
        del t, out_rs, in_rs, out_ag, in_ag, works, w
    held = sum(r() is not None for r in refs)
    if held:
        fails.append(f"rank {group.rank}: {held} of the caller's {len(refs)} tensors still alive after it dropped them")
    census[group.rank] = _posted_bytes(group)
    barrier.wait()
    if group.rank == 0:
        before, after = census["before"], live_storages()
        new = sum(b for p, b in after.items() if p not in before)
        posted = sum(census[r] for r in range(n))
        if new != posted:
            fails.append(f"{new} B of tensors alive that were not before, want {posted} B (the posted header "
                         "receives only)")
    barrier.wait()
    return fails


@pytest.mark.parametrize("kind,n", [("ring", 2), ("ring", 3), ("textbook", 3)])
def test_a_collective_keeps_nothing_once_done(kind, n):
    """Sync (run in the caller's thread) and async (run on the group's comm stream): after ``wait()`` the
    stream's thread holds no job, the tuned ring no scratch buffer, only the next header receives."""
    barrier, census = threading.Barrier(n), {}
    fails = [line for rank in run_ranks(_collectives_then_drop, n, (kind, barrier, census)) for line in rank]
    assert not fails, "\n".join(fails)


HOLD_S = 0.5  # how long each of the planted slow thread's two holds lasts


def test_torch_collectives_let_go_before_wait_returns():
    """torch's gloo worker thread marks a collective done, then drops it (and the tensors) when it next runs;
    and the thread that drops a tensor's last C++ reference lets go of its Python object only once it holds
    the GIL (torch keeps a tensor's Python object alive while C++ holds the tensor).  Planted here, both made
    certain: a slow thread that keeps every finished work ``HOLD_S`` longer, then the Python tensors it was
    given ``HOLD_S`` more.  ``get_collectives("torch")``'s ``wait()`` must still return only once nothing
    holds the caller's tensor: its memory is freed the moment the caller drops it (a weak reference to the
    storage: gloo holds an alias of the tensor, with the same bytes).  One rank of gloo, in this process."""
    group = dist.ProcessGroupGloo(dist.HashStore(), 0, 1)
    real, kept = dist.all_reduce, {}

    def let_go_later(work_key, args_key):
        time.sleep(HOLD_S)
        del kept[work_key]  # the C++ work, and with it the tensor's C++ references
        time.sleep(HOLD_S)
        del kept[args_key]  # then the Python objects

    def slow_to_let_go(*args, **kwargs):
        work = real(*args, **kwargs)
        keys = (object(), object())
        kept[keys[0]], kept[keys[1]] = work, args
        threading.Thread(target=let_go_later, args=keys).start()
        return work

    comm = C.get_collectives("torch")
    try:
        with mock.patch.object(dist, "all_reduce", slow_to_let_go):
            for async_op in (False, True):
                t = torch.ones(1000)
                memory = t.untyped_storage()._weak_ref()  # a weak reference to the bytes (gloo holds an alias)
                start = time.monotonic()
                work = comm.all_reduce(t, group=group, async_op=async_op)
                if work is not None:
                    work.wait()
                del t, work
                gone = torch.UntypedStorage._expired(memory)
                torch.UntypedStorage._free_weak_ref(memory)
                assert gone, f"async_op={async_op}: the tensor's memory outlives wait() " \
                    f"({time.monotonic() - start:.2f} s after the call)"
    finally:
        while kept:  # the slow thread's holds, before the group goes
            time.sleep(0.01)
        del group
