"""Our ``fully_shard`` against torch's FSDP2 on CUDA, fp32 and bf16 MixedPrecisionPolicy.

One spawn per world size over "nccl": 1 rank on one GPU (every parameter's rows are all of it, the
all-gather and reduce-scatter are NCCL's one-rank copies, the compute and the casts are real), and
2 ranks (one GPU each: skipped, and ``conftest.py`` says so, on a machine with fewer).

Oracle: torch's ``fully_shard`` on the same model, seed, data and mesh.  Tolerance: BITWISE (losses,
each rank's local rows, the full tensors): the same kernels on the same inputs (deterministic
algorithms, cuBLAS workspace fixed in ``conftest.py``), the same casts to bf16 before the all-gather
and back to fp32 after the reduce-scatter, and the same optimizer loop (``_workers_fsdp2_cuda.py``).
"""

import pytest

import minifsdp
from tests._workers_fsdp import assert_bitwise
from tests.gpu import _workers_fsdp2_cuda as W

WORLDS = [pytest.param(world, id=f"{world}rank", marks=[pytest.mark.gpus(world)]) for world in (1, 2)]


@pytest.fixture(scope="module", params=WORLDS)
def ranks(request):
    return minifsdp.spawn(W.fsdp2_worker, world_size=request.param, backend="nccl", timeout_s=300)


@pytest.mark.parametrize("precision", ("fp32", "bf16"))
def test_fully_shard_bitwise_vs_torch_fsdp2(ranks, precision):
    for rank, r in enumerate(ranks):
        assert r["device"] == f"cuda:{rank}"
        ours, theirs = r[f"ours/{precision}"], r[f"torch/{precision}"]
        assert ours["devices"] == theirs["devices"] == [f"cuda:{rank}"]
        assert_bitwise(ours["losses"], theirs["losses"], f"rank {rank} {precision}: losses")
        assert_bitwise(ours["locals"], theirs["locals"], f"rank {rank} {precision}: local rows")
        assert_bitwise(ours["full"], theirs["full"], f"rank {rank} {precision}: full tensors")
        assert ours["losses"][-1] < ours["losses"][0], ours["losses"]  # it trained
