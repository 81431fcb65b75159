"""minifsdp.spawn: results in rank order, failures named, nothing hangs."""

import os
import queue
import time

import pytest
import torch

import minifsdp
from minifsdp import launch
from minifsdp.launch import RankFailedError
from tests import _workers_launch as w


def test_results_come_back_in_rank_order():
    out = minifsdp.spawn(w.rank_and_sum, args=(10.0,), world_size=3)
    assert out == [(r, 3, 0.0 + 1 + 2 + 10.0) for r in range(3)]


def test_a_rank_that_raises_is_named_with_its_traceback():
    t0 = time.monotonic()
    with pytest.raises(RankFailedError) as info:
        minifsdp.spawn(w.raise_on_rank_one, world_size=2, timeout_s=60)
    assert info.value.rank == 1
    assert "rank one is unhappy" in str(info.value) and "Traceback" in str(info.value)
    assert time.monotonic() - t0 < 30, "the other rank should have been ended, not waited for"


def test_a_rank_killed_by_a_signal_is_reported():
    with pytest.raises(RankFailedError, match="SIGKILL") as info:
        minifsdp.spawn(w.kill_rank_one, world_size=2, timeout_s=60)
    assert info.value.rank == 1


def test_a_receive_that_never_completes_times_out():
    t0 = time.monotonic()
    with pytest.raises(RankFailedError) as info:
        minifsdp.spawn(w.wait_for_a_message_never_sent, world_size=2, timeout_s=10)
    assert info.value.rank == 0
    assert time.monotonic() - t0 < 60


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_bad_world_size_is_refused(bad):
    with pytest.raises(ValueError, match="world_size"):
        minifsdp.spawn(w.rank_and_sum, args=(0,), world_size=bad)


def test_lambda_is_refused_with_the_fix():
    with pytest.raises(ValueError, match="module level"):
        minifsdp.spawn(lambda: 1, world_size=1)


def test_tensor_results_survive_the_rank_exiting():
    import torch

    out = minifsdp.spawn(w.return_a_tensor, world_size=2)
    assert [t.tolist() for t in out] == [[0.0] * 3, [1.0] * 3] and all(isinstance(t, torch.Tensor) for t in out)


# --- which backends make a rank pick its GPU (no GPU needed) -------------------------------------


@pytest.mark.parametrize("backend, expected", [
    ("nccl", True), ("NCCL", True), ("cpu:gloo,cuda:nccl", True), ("cuda:nccl,cpu:gloo", True),
    ("cuda:nccl", True), (" cpu:gloo , cuda:NCCL ", True),
    ("gloo", False), ("cpu:gloo", False), ("GLOO", False), ("mpi", False)])
def test_uses_nccl(backend, expected):
    assert launch.uses_nccl(backend) is expected


@pytest.fixture
def set_device_calls(monkeypatch):
    """Record torch.cuda.set_device and make joining a group a no-op: the launcher's choice, in-process."""
    calls = []
    monkeypatch.setattr(launch.torch.cuda, "set_device", calls.append)
    monkeypatch.setattr(launch.dist, "init_process_group", lambda *a, **k: None)
    monkeypatch.setattr(launch.dist, "TCPStore", lambda *a, **k: None)
    monkeypatch.setattr(launch.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(launch, "init_process_group_for_this_attempt", lambda *a, **k: None)
    monkeypatch.setattr(launch, "_gather_through_store", lambda value, timeout_s: [value])
    monkeypatch.setattr(launch, "teardown", lambda: None)
    monkeypatch.setenv("LOCAL_RANK", "1")
    return calls


@pytest.mark.parametrize("backend, expected", [("nccl", [1]), ("cpu:gloo,cuda:nccl", [1]), ("gloo", [])])
def test_a_spawned_rank_sets_its_gpu_for_any_backend_with_nccl(set_device_calls, backend, expected):
    """spawn's rank body (_rank_main) for rank 1: set_device(1) before joining, on a mixed group too."""
    results = queue.Queue()
    launch._rank_main(1, 2, backend, "127.0.0.1", 0, 10.0, int, (), results, None, dict(os.environ))
    assert results.get_nowait()[:2] == ("ok", 1)
    assert set_device_calls == expected


@pytest.mark.parametrize("backend, expected", [("nccl", [1]), ("cpu:gloo,cuda:nccl", [1]), ("gloo", [])])
def test_a_torchrun_rank_sets_its_gpu_for_any_backend_with_nccl(set_device_calls, backend, expected):
    """Under torchrun: set_device(LOCAL_RANK) before joining, on a mixed group too."""
    assert launch._run_under_torchrun(int, (), backend, 10.0) == [0]
    assert set_device_calls == expected


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="checks the refusal with fewer than 2 GPUs")
def test_a_mixed_group_needs_a_gpu_per_rank_too():
    with pytest.raises(ValueError, match="NCCL needs one GPU per rank"):
        launch._check_world_size(2, "cpu:gloo,cuda:nccl")


def test_ranks_see_the_callers_environment_now_not_the_fork_servers(monkeypatch):
    """Ranks fork from a server started at the first spawn; a variable set after that must still reach them."""
    minifsdp.spawn(w.rank_and_sum, (0.0,), world_size=2)  # the fork server is running from here on
    monkeypatch.setenv("MINIFSDP_TEST_VARIABLE", "set after the server started")
    assert minifsdp.spawn(w.read_environment, ("MINIFSDP_TEST_VARIABLE",), world_size=2) == [
        ("set after the server started", 0), ("set after the server started", 1)]
    monkeypatch.delenv("MINIFSDP_TEST_VARIABLE")
    assert minifsdp.spawn(w.read_environment, ("MINIFSDP_TEST_VARIABLE",), world_size=2) == [(None, 0), (None, 1)]


def test_ranks_start_from_the_fork_server_not_a_plain_fork(monkeypatch):
    """Never ``fork`` from the caller (a torch thread pool may be running here); the fork server on Linux."""
    monkeypatch.setenv("MINIFSDP_START_METHOD", "fork")
    assert launch._start_method_context().get_start_method() == "spawn"
    monkeypatch.delenv("MINIFSDP_START_METHOD")
    ctx = launch._start_method_context()
    assert ctx.get_start_method() in ("forkserver", "spawn")
    if "forkserver" in torch.multiprocessing.get_all_start_methods():
        assert ctx.get_start_method() == "forkserver"
