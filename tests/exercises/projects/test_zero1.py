"""Grades project-zero1 (exercises/projects/zero1/README.md): ZeRO stage 1 against torch's ZeroRedundancyOptimizer.

``--impl=student`` grades ``exercises/projects/zero1/zero1.py``; ``--impl=reference`` the instructor's solution.

Oracle: torch as its users write ZeRO-1, ``DistributedDataParallel`` (averages the gradients) with
``torch.distributed.optim.ZeroRedundancyOptimizer`` (shards the optimizer; after its local step each rank
broadcasts the parameters it owns), on the same seed, data and TinyGPT (a tied and a frozen parameter), drawn
from the grading seed.  Two spawns of 3 ranks (``tests/exercises/projects/_workers_zero1.py``) run each on both
cases: torch's in one that runs no learner code, the learner's ``Zero1`` in the other (where the project's rule
keeps ``ZeroRedundancyOptimizer`` and torch FSDP out of reach); this process compares.  Points by test
(``@pytest.mark.points``): the numbers at 2 ranks, at 3 ranks, and the memory kept.

* 2 ranks, AdamW: bitwise, losses and every parameter after every step.  Any order of a sum of two numbers
  gives the same bits, dividing by 2 is exact, and AdamW's update is elementwise: whatever layout the
  optimizer state has, each number goes through the same arithmetic as torch's.
* 3 ranks, SGD with momentum: within ``rtol=1e-6, atol=1e-7``.  A sum of three numbers depends on its order:
  DDP divides each rank's gradient by 3 and gloo sums a whole bucket in its ring order, and no other
  all-reduce of the same numbers (gloo's per parameter, the book's ring, a sum before the divide) gives the
  same last bit of every gradient.  The differences seen: 5e-7 in a loss of 4.6, 7.5e-9 in a parameter;
  averaging wrongly by a factor or skipping a parameter moves a weight by 1e-4 or more.  The ranks must still
  agree bitwise with each other, every step (they hold replicas).
* Memory: the census (``minifsdp.memory.census.live_tensor_bytes``) after the first step and
  ``zero_grad(set_to_none=True)``, less before the optimizer was built: what the optimizer keeps between
  steps.  No rank may keep more than torch's fullest rank (its partition gives each rank whole parameters,
  sorted by size, to the least loaded rank); a copy of the whole state on every rank is N times that.
"""

import pytest
import torch

import minifsdp
from tests.exercises import learner_ranks, module_name, outcome_line
from tests.exercises.projects._workers_zero1 import CASES, STEPS, learner_on_rank, torch_on_rank

PROJECT = "project-zero1"


@pytest.fixture(scope="module")
def ranks(impl, course_seed):
    """Every rank's ``{case: {"torch": record, "yours": record}}``, or the learner's failure in one line (a str)."""
    try:
        yours = learner_ranks(learner_on_rank, (module_name("projects.zero1.zero1", impl), course_seed), 3, 240)
    except AssertionError as e:
        return str(e)
    raised = next((r["raised"] for r in yours if "raised" in r), None)
    if raised is not None:
        return outcome_line({"raised": raised})
    theirs = minifsdp.spawn(torch_on_rank, args=(course_seed,), world_size=3, timeout_s=180)
    return [{case: {"torch": theirs[r][case], "yours": yours[r][case]} for case in theirs[r]} for r in range(3)]


def _records(ranks, case):
    if isinstance(ranks, str):
        pytest.fail(f"{PROJECT}: {ranks}", pytrace=False)
    members = CASES[case][0]
    recs = [ranks[r][case] for r in members]
    assert len(recs) == len(members) and all(len(rec[w]["params"]) == STEPS for rec in recs for w in rec)
    return recs


def _param_diffs(want: dict, got: dict) -> list[str]:
    assert want.keys() == got.keys(), f"parameter names differ: {sorted(want.keys() ^ got.keys())}"
    return [n for n in want if not torch.equal(want[n], got[n])]


@pytest.mark.timeout(480)
@pytest.mark.points(12)
def test_project_zero1_bitwise_zero_redundancy_optimizer_at_2_ranks_adamw(ranks):
    for rank, rec in enumerate(_records(ranks, "pair")):
        theirs, yours = rec["torch"], rec["yours"]
        for step in range(STEPS):
            assert yours["losses"][step] == theirs["losses"][step], (
                f"rank {rank} step {step}: loss {yours['losses'][step]!r}, torch's {theirs['losses'][step]!r}")
            wrong = _param_diffs(theirs["params"][step], yours["params"][step])
            assert not wrong, f"rank {rank}, after step {step}: these parameters differ from torch's: {wrong}"


@pytest.mark.timeout(480)
@pytest.mark.points(10)
def test_project_zero1_close_to_zero_redundancy_optimizer_at_3_ranks_sgd(ranks):
    recs = _records(ranks, "world")
    for rank, rec in enumerate(recs):
        theirs, yours = rec["torch"], rec["yours"]
        for step in range(STEPS):
            torch.testing.assert_close(yours["losses"][step], theirs["losses"][step], rtol=1e-6, atol=0,
                                       msg=lambda m, s=step, r=rank: f"rank {r} step {s}: loss: {m}")
            want, got = theirs["params"][step], yours["params"][step]
            assert want.keys() == got.keys()
            for name in want:
                torch.testing.assert_close(got[name], want[name], rtol=1e-6, atol=1e-7,
                                           msg=lambda m, n=name, s=step, r=rank: f"rank {r}, {n} after step {s}: {m}")
            wrong = _param_diffs(recs[0]["yours"]["params"][step], got)
            assert not wrong, f"after step {step} rank {rank}'s replica differs from rank 0's in {wrong}"


@pytest.mark.timeout(480)
@pytest.mark.points(8)
@pytest.mark.parametrize("case", ["pair", "world"])
def test_project_zero1_keeps_a_shard_of_the_optimizer_state(ranks, case):
    recs = _records(ranks, case)
    fullest = max(rec["torch"]["state_bytes"] for rec in recs)
    for rank, rec in enumerate(recs):
        kept = rec["yours"]["state_bytes"]
        assert kept <= fullest, (
            f"{len(recs)} ranks ({CASES[case][1].__name__}): rank {rank} keeps {kept} bytes between steps, more than "
            f"torch's ZeroRedundancyOptimizer on its fullest rank ({fullest}): does every rank keep state for "
            "every parameter, or a copy of the weights?")
