"""Grades tasks 2.3a-b and 2.4: ``exercises/memory_tasks.py`` (``--impl=student``) or the instructor's answer,
run in the learner's process.

Oracles: 2.3a the ZeRO paper's published numbers (Figure 1: Ψ = 7.5B, N = 64), small cases done by hand,
and sizes drawn from the grading seed against the paper's definition (2 + 2 + 12 bytes per parameter, stage k
sharding the optimizer state, then the gradients, then the parameters), so a table of the fixed cases is no
answer; 2.3b and 2.4 a *measurement*, not a formula: one spawn of 3 ranks (tests/_workers_memory_ex.py, no
learner code) trains TinyGPT (its vocabulary drawn from the grading seed) one AdamW step with our DDP and our
FSDP (FULL_SHARD, SHARD_GRAD_OP, NO_SHARD; ring collectives) at world sizes 2 and 3, and records per rank the
model state held at rest (``snapshot``: bytes of the tensors' storages) and the bytes ``count_bytes()`` saw
sent.  Bytes are integers: every comparison is exact.

Each test calls the function once on a small case *before* asking for the measurement, so a function that
raises fails at once and never waits for the spawn.
"""

import random

import pytest

import minifsdp
from tests._workers_memory_ex import SETUPS, measure_memory_and_bytes


def _fn(learner, name):
    return getattr(learner("memory_tasks"), name)


@pytest.fixture(scope="module")
def measured(course_seed):
    """{world size: [rank 0's, rank 1's, ...]} of {setup: {units, sent, messages, model_state}}."""
    vocab = random.Random(f"{course_seed}:2.3b").randint(40, 160)
    ranks = minifsdp.spawn(measure_memory_and_bytes, args=(vocab,), world_size=3, timeout_s=120)
    return {n: [r[n] for r in ranks if n in r] for n in (2, 3)}


def _zero_paper(psi: float, n: int, stage: int) -> float:
    """The ZeRO paper's model state per rank: fp16 parameters (2Ψ), fp16 gradients (2Ψ), fp32 optimizer state
    (12Ψ); stage 1 shards the optimizer state over N, stage 2 the gradients too, stage 3 the parameters too."""
    params, grads, optim = 2 * psi, 2 * psi, 12 * psi
    return params / (n if stage >= 3 else 1) + grads / (n if stage >= 2 else 1) + optim / (n if stage >= 1 else 1)


def test_task2_3a_zero_stages(learner, course_seed):
    f = _fn(learner, "model_state_bytes_per_rank")
    assert f(1000, 4, 0) == 16000
    # the ZeRO paper's Figure 1: 120 GB, 31.4 GB, 16.6 GB, 1.9 GB
    psi, n = 7.5e9, 64
    assert [f(psi, n, s) for s in range(4)] == [120e9, 31.40625e9, 16.640625e9, 1.875e9]
    assert f(1000, 4, 1) == 4000 + 3000  # 4Ψ + 12Ψ/N
    assert f(1000, 4, 2) == 2000 + 3500  # 2Ψ + 14Ψ/N
    assert f(1000, 4, 3) == 4000  # 16Ψ/N
    assert f(1000, 1, 3) == f(1000, 1, 0) == 16000  # one rank: nothing to shard
    assert all(f(1000, n, 0) == 16000 for n in (1, 2, 8))  # DDP: every rank holds everything
    with pytest.raises(ValueError):
        f(1000, 4, 4)
    rng = random.Random(f"{course_seed}:2.3a")
    for _ in range(8):  # drawn at grading time: a table of the cases above is not an answer
        psi, n, stage = rng.randrange(10**3, 10**11, 8), rng.choice([1, 2, 3, 5, 8, 16, 64, 1024]), rng.randint(0, 3)
        got, want = f(psi, n, stage), _zero_paper(psi, n, stage)
        assert abs(got - want) <= 1e-9 * want, f"Ψ = {psi}, N = {n}, stage {stage}: you say {got}, the paper's {want}"


@pytest.mark.timeout(180)
def test_task2_3b_fsdp_model_state_measured(learner, request):
    f = _fn(learner, "fsdp_model_state_bytes_per_rank")
    assert f([10], 4) == 16 * 3 + 4  # 10 elements on 4 ranks: 3 per rank (padding), AdamW's step
    assert f([8, 8], 1) == 16 * 16 + 2 * 4
    measured = request.getfixturevalue("measured")
    checked = 0
    for n, ranks in measured.items():
        assert len(ranks) == n, f"world size {n}: {len(ranks)} ranks measured"
        for rank, res in enumerate(ranks):
            for kind in ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"):
                units, got = res[kind]["units"], res[kind]["model_state"]
                assert len(units) == 3, units  # the root and two blocks
                # NO_SHARD keeps the whole unit on every rank: what one rank alone holds
                want = f(units, 1 if kind == "NO_SHARD" else n)
                assert want == got, (f"{kind}, {n} ranks, rank {rank}, units {units}: you predict {want} bytes, "
                                     f"the rank holds {got} (measured from its tensors)")
                checked += 1
    assert checked == 3 * (2 + 3)


@pytest.mark.timeout(180)
def test_task2_4_bytes_sent_measured(learner, request):
    f = _fn(learner, "bytes_sent_per_rank")
    assert f([4, 4], 1, "FULL_SHARD") == 0  # one rank: no ring, nothing sent
    assert f([8, 8], 2, "SHARD_GRAD_OP", itemsize=2) == 2 * (4 + 4) * 2  # (N-1)/N = 1/2 of each, twice
    with pytest.raises(ValueError):
        f([8], 2, "HYBRID")
    measured = request.getfixturevalue("measured")
    checked = 0
    for n, ranks in measured.items():
        assert len(ranks) == n, f"world size {n}: {len(ranks)} ranks measured"
        units = ranks[0]["FULL_SHARD"]["units"]
        for rank, res in enumerate(ranks):
            for kind in SETUPS:
                want, got = f(units, n, kind, rank=rank), res[kind]["sent"]
                assert want == got, (f"{kind}, {n} ranks, rank {rank}, units {units}: you predict {want} bytes "
                                     f"sent, count_bytes() counted {got} ({res[kind]['messages']} messages)")
                checked += 1
    assert checked == len(SETUPS) * (2 + 3)
    # what the chapter says, read off the measurement: FULL_SHARD moves more than DDP, SHARD_GRAD_OP the same
    r0 = measured[2][0]
    assert r0["SHARD_GRAD_OP"]["sent"] == r0["DDP"]["sent"] < r0["FULL_SHARD"]["sent"]
