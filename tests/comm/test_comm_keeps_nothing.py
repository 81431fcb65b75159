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


LETS_GO_HOLD_S = 0.2  # each of the planted thread's two holds, in the torch_lets_go test below


def _fsdp1_all_gather(out: torch.Tensor, inp: torch.Tensor, group) -> None:
    """torch FSDP1's all-gather on the CPU: a list of chunks, ``dist.all_gather`` (``_flat_param.py``,
    ``FlatParamHandle._all_gather_flat_param``; on a GPU it calls ``all_gather_single``)."""
    dist.all_gather(list(torch.chunk(out, dist.get_world_size(group))), inp, group=group)


def _fsdp1_reduce_scatter(out: torch.Tensor, inp: torch.Tensor, group) -> None:
    """torch FSDP1's reduce-scatter (``_runtime_utils.py``, ``_reduce_grad``): positional tensors."""
    dist.reduce_scatter_single(out, inp, group=group)


def _fsdp2_all_gather(out: torch.Tensor, inp: torch.Tensor, group) -> None:
    """torch FSDP2's, its own object (``_fsdp_collectives.py``'s ``DefaultAllGather``), called as
    ``foreach_all_gather`` calls it: keywords, async, then waited on."""
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather

    DefaultAllGather()(output_tensor=out, input_tensor=inp, group=group, async_op=True).wait()


def _fsdp2_reduce_scatter(out: torch.Tensor, inp: torch.Tensor, group) -> None:
    """torch FSDP2's ``DefaultReduceScatter`` as ``foreach_reduce`` calls it; it calls
    ``dist.reduce_scatter_single(output=..., input=...)``: keywords only."""
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter

    DefaultReduceScatter()(output_tensor=out, input_tensor=inp, group=group, op=dist.ReduceOp.SUM)


def _both_all_reduce(out: torch.Tensor, inp: torch.Tensor, group) -> None:
    """FSDP1's NO_SHARD and clipping, FSDP2's HSDP: ``dist.all_reduce(t, group=...)``."""
    dist.all_reduce(inp, group=group)
    out.copy_(inp)


_TORCH_FSDP_CALLS = {"fsdp1_all_gather": ("all_gather", _fsdp1_all_gather),
                     "fsdp1_reduce_scatter": ("reduce_scatter_single", _fsdp1_reduce_scatter),
                     "fsdp2_all_gather": ("all_gather_single", _fsdp2_all_gather),
                     "fsdp2_reduce_scatter": ("reduce_scatter_single", _fsdp2_reduce_scatter),
                     "all_reduce": ("all_reduce", _both_all_reduce)}


@pytest.mark.parametrize("call", list(_TORCH_FSDP_CALLS))
def test_torch_lets_go_covers_each_collective_torch_fsdp_calls(call):
    """``torch_lets_go()`` (what the census comparisons with torch run torch's side in) must hold back each
    collective torch's FSDP1 and ``fully_shard`` call, called as they call it (positional, keywords, a list of
    chunks), until gloo's thread lets go of the tensors.  Planted as above: a slow thread that keeps each work
    ``LETS_GO_HOLD_S``, then its arguments as long again.  Once the call returns, the input the caller drops must
    be freed at once (a weak reference to its storage).  The calls' names are torch 2.13's (``dist.all_gather``
    on the CPU for FSDP1, ``all_gather_single`` for FSDP2, ``reduce_scatter_single`` for both); one rank of gloo,
    the default group of this process for the test's length (the single-tensor calls need one)."""
    name, issue = _TORCH_FSDP_CALLS[call]
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    group = dist.group.WORLD
    real, kept = getattr(dist, name), {}

    def let_go_later(work_key, args_key):
        time.sleep(LETS_GO_HOLD_S)
        del kept[work_key]
        time.sleep(LETS_GO_HOLD_S)
        del kept[args_key]

    def slow_to_let_go(*args, **kwargs):
        work = real(*args, **kwargs)
        keys = (object(), object())
        kept[keys[0]], kept[keys[1]] = work, (args, kwargs)
        threading.Thread(target=let_go_later, args=keys).start()
        return work

    try:  # (a wait that gives up at its deadline would free it too: a deadline of 60 s tells the two apart)
        with mock.patch.object(dist, name, slow_to_let_go), mock.patch.object(C, "LET_GO_S", 60.0), \
                C.torch_lets_go():
            out, inp = torch.empty(1000), torch.ones(1000)
            memory = inp.untyped_storage()._weak_ref()
            start = time.monotonic()
            issue(out, inp, group)
            took = time.monotonic() - start
            del inp
            gone = torch.UntypedStorage._expired(memory)
            torch.UntypedStorage._free_weak_ref(memory)
            assert torch.equal(out, torch.ones(1000)), "the collective's result"
            assert gone, f"{call}: the input's memory outlives the call inside torch_lets_go (dist.{name})"
            assert took < 30, f"{call}: the wait ran to its deadline ({took:.1f} s): it never saw gloo let go"
    finally:
        while kept:  # the slow thread's holds, before the group goes
            time.sleep(0.01)
        dist.destroy_process_group()
