"""Our ``fully_shard`` against torch's FSDP2 on CUDA, fp32 and bf16 MixedPrecisionPolicy.

One spawn per world size over "nccl": 1 rank on one GPU (every parameter's rows are all of it, the
all-gather and reduce-scatter are NCCL's one-rank copies, the compute and the casts are real), and
2 ranks (one GPU each: skipped, and ``conftest.py`` says so, on a machine with fewer).

Oracle: torch's ``fully_shard`` on the same model, seed, data and mesh.  Tolerance: BITWISE (losses,
each rank's local rows, the full tensors): the same kernels on the same inputs (deterministic
algorithms, cuBLAS workspace fixed in ``conftest.py``), the same casts to bf16 before the all-gather
and back to fp32 after the reduce-scatter, and the same optimizer loop (``_workers_fsdp2_cuda.py``).
"""

import numpy as np
import pytest

import minifsdp
from tests.gpu import _workers_fsdp2_cuda as W

WORLDS = [pytest.param(world, id=f"{world}rank", marks=[pytest.mark.gpus(world)]) for world in (1, 2)]


@pytest.fixture(scope="module", params=WORLDS)
def ranks(request):
    return minifsdp.spawn(W.fsdp2_worker, world_size=request.param, backend="nccl", timeout_s=300)


def _same(a, b, what):
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape and a.dtype == b.dtype, (what, a.shape, b.shape, a.dtype, b.dtype)
    diff = np.abs(a.astype(np.float64) - b.astype(np.float64)).max() if a.size else 0.0
    assert np.array_equal(a, b), f"{what}: not bitwise, max |diff| = {diff:.3g}"


@pytest.mark.parametrize("precision", ("fp32", "bf16"))
def test_fully_shard_bitwise_vs_torch_fsdp2(ranks, precision):
    for rank, r in enumerate(ranks):
        assert r["device"] == f"cuda:{rank}"
        ours, theirs = r[f"ours/{precision}"], r[f"torch/{precision}"]
        assert ours["devices"] == theirs["devices"] == [f"cuda:{rank}"]
        _same(ours["losses"], theirs["losses"], f"rank {rank} {precision} losses")
        assert list(ours["locals"]) == list(theirs["locals"]), "the two name their parameters differently"
        for name in theirs["locals"]:
            _same(ours["locals"][name], theirs["locals"][name], f"rank {rank} {precision} local rows of {name}")
            _same(ours["full"][name], theirs["full"][name], f"rank {rank} {precision} full {name}")
        assert ours["losses"][-1] < ours["losses"][0], ours["losses"]  # it trained
