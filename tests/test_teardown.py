"""Teardown: nothing of ours is left running when a rank's interpreter shuts down.

The bug these guard against: notebook 01's train_ddp.py under torchrun aborted at exit
in 4 of 60 runs on a 2-core machine ("terminate called without an active exception", exit code -6).
spawn gathered the ranks' results with a gloo all_gather_object; gloo's worker thread
drops its reference to a finished work (tensors made in Python) a moment *after* wait()
returns, and if the interpreter was already shutting down, that thread died in a C++
destructor while asking for the GIL.  spawn now gathers through the store, and teardown
stops our comm-stream threads before it destroys the group.
"""

import json
import subprocess
import sys
import threading
import weakref
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from minifsdp import launch
from minifsdp.comm import collectives as C
from minifsdp.comm import stream as S
from tests import _teardown_loop

ROOT = Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------------------- comm stream: close
def test_close_finishes_queued_jobs_then_stops_the_thread():
    s = S.CommStream("close-test")
    gate, done = threading.Event(), []
    s.submit(gate.wait)  # holds the thread until we let it go
    works = [s.submit(lambda i=i: done.append(i)) for i in range(3)]
    gate.set()
    assert s.close(timeout=10)
    assert not s.is_alive()
    assert done == [0, 1, 2] and all(w.is_completed() for w in works)
    with pytest.raises(RuntimeError, match="closed"):
        s.submit(lambda: None)
    assert s.close(timeout=1)  # twice is fine


def test_a_finished_job_lets_go_of_its_tensors_at_once():
    """A job closes over the tensors it moves; once it has run, nothing of ours may keep them alive (a
    thread holding its last job until the next one arrived kept a unit's whole gradient, or a dropped
    model's bucket, alive in between)."""
    s = S.CommStream("release-test")
    t = torch.ones(1000)
    ref = weakref.ref(t)
    s.submit(lambda t=t: t.add_(1)).wait()
    del t
    assert ref() is None
    assert s.close(timeout=10)


def test_close_streams_stops_every_thread_and_forgets_the_groups():
    groups = [object(), object()]
    for g in groups:
        S.stream_for(g).synchronize()
    assert len([n for n in S.live_streams() if n.endswith(tuple(str(id(g)) for g in groups))]) == 2
    assert S.close_streams(timeout=10) == []
    assert S.live_streams() == []
    assert all(g not in S._STREAMS for g in groups)  # the table no longer keeps the groups alive
    assert S.stream_for(groups[0]) is not None  # a later collective starts a new stream
    assert S.close_streams(timeout=10) == []


def test_a_stuck_job_is_reported_not_waited_for_forever():
    gate = threading.Event()
    stream = S.stream_for(object())
    stream.submit(gate.wait)  # a job that never ends on its own
    try:
        assert S.close_streams(timeout=0.2) == [f"minifsdp-comm-{stream.name}"]
    finally:
        gate.set()
    assert stream.close(timeout=10)  # once the job ends, the stop marker queued behind it ends the thread
    assert S.live_streams() == []


# ----------------------------------------------------------------------------- launch.teardown
def test_teardown_stops_the_comm_streams_before_it_destroys_the_group():
    order = []

    def hook():
        order.append(("hook", dist.is_initialized(), sorted(S.live_streams())))

    launch.on_teardown(hook)
    try:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        t = torch.arange(4.0)
        C.ring_all_reduce(t)  # starts the group's comm stream
        assert S.live_streams()
        launch.teardown()
        assert not dist.is_initialized()
        assert S.live_streams() == []
        # Our hook ran while the group still existed; the stream hook (registered at import,
        # so run after ours: hooks run last in, first out) had not closed the stream yet.
        assert order and order[0][1] is True
        launch.teardown()  # twice is fine
    finally:
        launch._TEARDOWN_HOOKS.remove(hook)
        if dist.is_initialized():
            dist.destroy_process_group()


# ----------------------------------------------------------------------------- under torchrun
@pytest.mark.timeout(180)
def test_under_torchrun_spawn_leaves_no_collective_and_exit_leaves_no_thread(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(ROOT / "tests" / "_teardown_script.py"), str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=170,
    )
    assert proc.returncode == 0 and "terminate called" not in proc.stderr, proc.stdout[-3000:] + proc.stderr[-3000:]
    for rank in range(2):
        out = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert out["results"] == [103.0, 103.0]  # ring sum 0+1, gloo sum 2, offset 100
        assert out["world_size_after_spawn"] == 2
        assert out["seq_after_spawn"] == out["seq_after_fn"], "spawn's gather must not run a collective on the group"
        assert out["streams_after_spawn"], "fn ran ring collectives: a comm stream should exist"
        assert out["at_exit"] == {"initialized": False, "streams": []}


@pytest.mark.timeout(240)
def test_notebook_01_train_ddp_under_torchrun_exits_cleanly_3_times():
    runs = _teardown_loop.run_loop(3)
    failed = [r for r in runs if r.failed]
    assert not failed, f"{len(failed)} of 3 runs failed; first:\n" + failed[0].stderr[-3000:]
    for r in runs:
        assert r.stdout.count("losses:") == 2  # both ranks' losses, printed by rank 0
