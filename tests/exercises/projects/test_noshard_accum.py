"""Grades project-noshard-accum (exercises/projects/noshard_accum/README.md): gradient accumulation under no_sync.

``--impl=student`` grades ``exercises/projects/noshard_accum/accumulate.py``; ``--impl=reference`` the
instructor's solution.  Two spawns of 3 ranks (``tests/exercises/projects/_workers_noshard_accum.py``): torch's
users' accumulation (no learner code), then the learner's functions; world sizes 3 and 2, FULL_SHARD and
SHARD_GRAD_OP, TinyGPT with its blocks wrapped (units of 4,160, 12,704 and 12,704 numbers: 3 divides none of
them), K = 3 micro-batches drawn from the grading seed.  ``predict`` runs in the learner's process.  Points by
test (``@pytest.mark.points``): the gradients, the bytes sent, the bytes held, the measurement.  Oracles:

* gradients: torch FSDP1 accumulating as its users do (``no_sync()`` around the forward and backward of all but
  the last micro-batch, each loss divided by K).  Bitwise: your ``accumulate`` on torch FSDP1 (both world sizes)
  and on our FSDP with the book's ring (2 ranks; at 3 ranks a ring sums three numbers in another order than
  gloo, so our FSDP is not bitwise torch's there and only torch FSDP1 is graded);
* bytes sent per micro-batch: ``count_bytes()`` around your ``accumulate`` on our FSDP, read after each
  micro-batch (exact);
* bytes held after each micro-batch and the peak during it: a ``MemoryTracker`` around your ``accumulate`` on
  torch FSDP1, marked after each micro-batch, less the bytes when it started; its count at each mark is the
  census's (``found_at_exit == 0`` is the census's audit).  Held: exact.  Peak: your ``measure`` within 1%
  of the tracker's, since a tracker started before or after your own bookkeeping (a list, a counter) sees a
  few hundred bytes more or less; the peak of the first micro-batch and of the later ones differ by 24%.
"""

import pytest
import torch

import minifsdp
from tests.exercises import learner_ranks, module_name, outcome_line
from tests.exercises.projects._workers_noshard_accum import STRATEGIES, WORLDS, K, learner_on_rank, torch_on_rank

PROJECT = "project-noshard-accum"


@pytest.fixture(scope="module")
def ranks(impl, course_seed):
    """Every rank's ``{world size: {strategy: record}}`` (the oracle's under "oracle"), or the learner's failure
    in one line (a str)."""
    try:
        yours = learner_ranks(learner_on_rank, (module_name("projects.noshard_accum.accumulate", impl), course_seed),
                              3, 300)
    except AssertionError as e:
        return str(e)
    raised = next((r["raised"] for r in yours if "raised" in r), None)
    if raised is not None:
        return outcome_line({"raised": raised})
    theirs = minifsdp.spawn(torch_on_rank, args=(course_seed,), world_size=3, timeout_s=300)
    for mine, oracle in zip(yours, theirs, strict=True):
        for n in oracle:
            for strategy in oracle[n]:
                mine[n][strategy]["oracle"] = oracle[n][strategy]
    return yours


def _predict(learner):
    """The learner's ``predict``, run in the learner's process."""
    return learner("projects.noshard_accum.accumulate").predict


def _records(ranks, strategy):
    """[(world size, rank, record)] for every world size and rank."""
    if isinstance(ranks, str):
        pytest.fail(f"{PROJECT}: {ranks}", pytrace=False)
    out = [(n, rank, ranks[rank][n][strategy]) for n, members in WORLDS.items() for rank in members]
    assert len(out) == sum(len(m) for m in WORLDS.values())
    for n, rank, rec in out:
        assert rec["torch"]["units"] == rec["ours"]["units"], "torch's units and ours differ: the setup is wrong"
        assert rec["torch"]["audit"] == 0, f"{n} ranks, rank {rank}: the census found bytes the tracker missed"
    return out


def _same(got: list, want: list) -> bool:
    return len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.timeout(720)
@pytest.mark.points(10)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_project_noshard_accum_gradients_bitwise_torch_fsdp1(ranks, strategy):
    for n, rank, rec in _records(ranks, strategy):
        where = f"{strategy}, {n} ranks, rank {rank}"
        oracle = rec["oracle"]
        runs = [("torch FSDP1", rec["torch"])] + ([("our FSDP", rec["ours"])] if n == 2 else [])
        for name, run in runs:
            assert run["losses"] == oracle["losses"], (
                f"{where}, {name}: your accumulate returned losses {run['losses']}, torch's users get "
                f"{oracle['losses']} (each micro-batch's loss divided by K = {K})")
            assert _same(run["grads"], oracle["grads"]), (
                f"{where}, {name}: the sharded gradients after your accumulate differ from torch FSDP1's")


@pytest.mark.timeout(720)
@pytest.mark.points(6)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_project_noshard_accum_predicts_the_bytes_sent(learner, request, strategy):
    predict = _predict(learner)
    predict([10, 20], 2, "FULL_SHARD", 2)  # a small case first: a function that raises fails before any spawn
    for n, rank, rec in _records(request.getfixturevalue("ranks"), strategy):
        want = rec["ours"]["sent"]
        got = [m["sent"] for m in predict(rec["torch"]["units"], n, strategy, K)]
        assert got == want, (f"{strategy}, {n} ranks, rank {rank}, units {rec['torch']['units']}: you predict "
                             f"{got} bytes sent per micro-batch, count_bytes() measured {want}")


@pytest.mark.timeout(720)
@pytest.mark.points(6)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_project_noshard_accum_predicts_the_bytes_held(learner, request, strategy):
    predict = _predict(learner)
    with pytest.raises(ValueError):
        predict([10, 20], 2, "NO_SHARD", 2)
    for n, rank, rec in _records(request.getfixturevalue("ranks"), strategy):
        want = rec["torch"]["held"]
        got = [m["held"] for m in predict(rec["torch"]["units"], n, strategy, K)]
        assert got == want, (f"{strategy}, {n} ranks, rank {rank}, units {rec['torch']['units']}: you predict "
                             f"{got} bytes held after each micro-batch, torch FSDP1 holds {want} (the census)")


@pytest.mark.timeout(720)
@pytest.mark.points(8)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_project_noshard_accum_measures_each_micro_batch(ranks, strategy):
    for n, rank, rec in _records(ranks, strategy):
        if n != 2:
            continue
        if "measure_not_done" in rec:
            pytest.fail(f"{PROJECT}: measure: {rec['measure_not_done']}", pytrace=False)
        where = f"{strategy}, {n} ranks, rank {rank}"
        on_torch, on_ours = rec["measured_torch"], rec["measured_ours"]
        assert len(on_torch) == len(on_ours) == K, f"{where}: measure returned {len(on_torch)} rows, want {K}"
        sent = [m["sent"] for m in on_ours]
        assert sent == rec["ours"]["sent"], (f"{where}: you measured {sent} bytes sent, count_bytes() saw "
                                             f"{rec['ours']['sent']}")
        held = [m["held"] for m in on_torch]
        assert held == rec["torch"]["held"], (f"{where}: you measured {held} bytes held, the census "
                                              f"{rec['torch']['held']}")
        for k, (m, want) in enumerate(zip(on_torch, rec["torch"]["peak"], strict=True)):
            assert abs(m["peak"] - want) <= 0.01 * want, (
                f"{where}, micro-batch {k}: you measured a peak of {m['peak']} bytes, the tracker {want} "
                "(the highest live tensor bytes during the micro-batch, less those before the first)")
