"""Our FSDP on a CUDA stream that is not the default one, with the GPU running far behind the host.

What it proves (one GPU, one rank, "nccl"): every all-gather and reduce-scatter our FSDP issues waits
for the work queued before it on the stream it was issued from, and no buffer a collective reads or
writes is freed or reused before the collective is done: trained under ``torch.cuda.stream(side)``
with ``torch.cuda._sleep`` delays before each unit's forward, on each Block's output gradient and
before each optimizer step (``_workers_streams.py``), the losses and parameters are BITWISE those of
the same run on the default stream without delays (the same kernels on the same numbers; only when
they run moves).  HYBRID_SHARD over ``(WORLD, WORLD)`` keeps the all-gathers and reduce-scatters at
one rank, and is BITWISE our NO_SHARD run there (a sum of one number is that number).

Guards (the check can fail): with the same delay, an all-gather issued from the default stream while
the side stream writes its input reads the old numbers, and issued from the side stream the new ones;
and with a fault planted in our FSDP (each all-gather issued while another stream is current), the
delayed run is no longer bitwise the default-stream run.

Not shown here: how much communication overlaps compute across GPUs (chapter 2.5): that needs two GPUs.
"""

import pytest

import minifsdp
from tests._workers_fsdp import assert_bitwise
from tests.gpu import _workers_streams as W


@pytest.fixture(scope="module")
def run():
    return minifsdp.spawn(W.streams_worker, world_size=1, backend="nccl", timeout_s=300)[0]


def _bitwise(a: dict, b: dict, what: str) -> None:
    assert_bitwise(a["losses"], b["losses"], f"{what}: losses")
    assert_bitwise(a["params"], b["params"], f"{what}: parameters")


def test_guard_an_unordered_collective_reads_old_numbers(run):
    assert run["guard"] == {"unordered_read_old_numbers": True, "ordered_read_new_numbers": True}, run["guard"]


def test_the_delayed_run_gathered_and_reduce_scattered_on_a_side_stream(run):
    delayed = run["delayed"]
    assert delayed["stream_was_default"] is False
    assert delayed["counts"].get("all_gather", 0) >= 3 * W.STEPS, delayed["counts"]
    assert delayed["counts"].get("reduce_scatter", 0) >= 3 * W.STEPS, delayed["counts"]
    assert run["plain"]["stream_was_default"] is True and run["plain"]["counts"] == delayed["counts"]


def test_side_stream_with_delays_is_bitwise_the_default_stream_run(run):
    _bitwise(run["delayed"], run["plain"], "side stream + delays vs default stream")


def test_guard_an_all_gather_issued_off_the_step_stream_is_caught(run):
    assert run["planted"]["counts"] == run["delayed"]["counts"]  # the same collectives, issued elsewhere
    with pytest.raises(AssertionError, match="numbers differ"):
        _bitwise(run["planted"], run["plain"], "planted fault vs default stream")


def test_hybrid_one_by_one_is_bitwise_no_shard(run):
    _bitwise(run["plain"], run["no_shard"], "HYBRID_SHARD (1 x 1) vs NO_SHARD")
    assert run["no_shard"]["losses"][-1] < run["no_shard"]["losses"][0]
