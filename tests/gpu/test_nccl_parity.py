"""The parity subset on NCCL: ours against torch FSDP1 / DDP with every model on the GPU.

One spawn per backend and world size: a plain "nccl" group (no CPU tensor may enter a
collective: the wrap-time checksum, DDP's signature and broadcasts, the grad scaler's
flag all live on the GPU) and "cpu:gloo,cuda:nccl" (control tensors on CPU through
gloo, the rest on NCCL); 1 rank on one GPU, and 2 ranks (one GPU each: skipped, and
``conftest.py`` says so, on a machine with fewer).  At 1 rank both FSDP1s run
NO_SHARD, so the 2-rank runs are the ones that reduce-scatter across GPUs.

Oracles and tolerances:
* torch FSDP1 (same nested wrapping, ``use_orig_params=False``): BITWISE for losses,
  clip norms, each rank's flat shards and the full parameters, as on CPU: the same
  kernels run on the same inputs (deterministic algorithms, cuBLAS workspace fixed in
  ``conftest.py``) and the same NCCL reduce-scatter sums the same two numbers per element;
* our FSDP with activation checkpointing vs without: BITWISE (the recompute replays the
  CUDA RNG and autocast state and reruns the same kernels);
* torch DDP at 2 ranks: BITWISE (both scale by 1/N into the bucket, then an NCCL SUM of
  two numbers, a + b == b + a);
* fp16 + our ShardedGradScaler vs torch's: BITWISE parameters, the same scales, and both
  ranks skip the step where only rank 1 saw an inf.
If a GPU/driver combination picks different kernels for the two sides, the assertion
message prints the largest difference, to be named here as a tolerance with its reason.
"""

import pytest

import minifsdp
from tests._workers_fsdp import assert_bitwise, assert_same_training
from tests.gpu import _workers_gpu as W

BACKENDS = ("nccl", "cpu:gloo,cuda:nccl")
RUNS = [pytest.param((backend, world), id=f"{backend}-{world}rank", marks=[pytest.mark.gpus(world)])
        for world in (1, 2) for backend in BACKENDS]


@pytest.fixture(scope="module", params=RUNS)
def ranks(request):
    backend, world = request.param
    return minifsdp.spawn(W.gpu_worker, args=(backend,), world_size=world, backend=backend,
                          timeout_s=300), backend


def _bitwise(ours, theirs, what, norms=True):
    """Losses, clip norms (``norms``), each local flat shard and every full parameter: bit for bit."""
    if not norms:
        ours, theirs = ({k: v for k, v in d.items() if k != "norms"} for d in (ours, theirs))
    assert_same_training(ours, theirs, what)


@pytest.mark.timeout(600)
def test_ranks_ran_on_their_gpus(ranks):
    runs, backend = ranks
    assert [r["backend"] for r in runs] == [backend] * len(runs)
    assert [r["device"] for r in runs] == [f"cuda:{rank}" for rank in range(len(runs))]
    for rank, r in enumerate(runs):
        assert r["fsdp"]["FULL_SHARD"]["ours"]["devices"] == [f"cuda:{rank}"]


@pytest.mark.parametrize("strategy", ("FULL_SHARD", "SHARD_GRAD_OP"))
def test_fsdp_bitwise_vs_torch_fsdp1(ranks, strategy):
    for rank, r in enumerate(ranks[0]):
        _bitwise(r["fsdp"][strategy]["ours"], r["fsdp"][strategy]["torch"], f"rank {rank} {strategy}")


def test_bf16_mixed_precision_bitwise_vs_torch_fsdp1(ranks):
    for rank, r in enumerate(ranks[0]):
        _bitwise(r["mp_bf16"]["ours"], r["mp_bf16"]["torch"], f"rank {rank} bf16 MixedPrecision")


def test_fsdp_checkpointed_bitwise(ranks):
    for rank, r in enumerate(ranks[0]):
        _bitwise(r["fsdp"]["checkpointed"], r["fsdp"]["FULL_SHARD"]["ours"], f"rank {rank} checkpointed")


def test_ddp_bitwise_vs_torch_ddp(ranks):
    for rank, r in enumerate(ranks[0]):
        theirs = r["ddp"]["torch"]
        for layout in ("reverse", "torch"):
            assert_bitwise(r["ddp"][layout], theirs, f"rank {rank} DDP {layout}")


def test_grad_scaler_vs_torch_and_flags_agree(ranks):
    runs = ranks[0]
    for rank, r in enumerate(runs):
        ours, theirs = r["scaler"]["ours"], r["scaler"]["torch"]
        _bitwise(ours, theirs, f"rank {rank} fp16 scaler", norms=False)
        assert ours["scales"] == theirs["scales"]
        assert ours["stepped"] == theirs["stepped"] == [True, False, True, True]  # the inf was on the last rank only
    # 2 ranks: rank 0 has no gradients at all, rank 1 overflows at step 1: the same flags and scales on both.
    # 1 rank: it has gradients and overflows at step 1; its flag goes through a one-rank all-reduce.
    flags = [r["scaler"]["flags"] for r in runs]
    for f in flags[1:]:
        assert [(a, s) for a, _, _, s in f] == [(a, s) for a, _, _, s in flags[0]]
    assert [f for f, *_ in flags[0]] == [0.0, 1.0, 0.0]
    assert [stepped for _, _, stepped, _ in flags[-1]] == [True, False, True]


def test_wrap_time_checks_on_the_gpu(ranks):
    runs, backend = ranks
    for r in runs:
        checks = r["checks"]
        if len(runs) > 1:
            assert checks["different_weights"] and "differs across ranks" in checks["different_weights"]
        assert_bitwise(checks["synced_full"], runs[0]["checks"]["rank0_full"], "sync_module_states")
        if backend == "nccl":
            assert "FSDP: the module is on cpu" in checks["cpu_fsdp"], checks["cpu_fsdp"]
            assert "DistributedDataParallel: the module is on cpu" in checks["cpu_ddp"], checks["cpu_ddp"]
