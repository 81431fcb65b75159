"""minifsdp.spawn: results in rank order, failures named, nothing hangs."""

import time

import pytest

import minifsdp
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
