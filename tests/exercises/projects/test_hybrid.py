"""Grades project-hybrid (exercises/projects/hybrid/README.md): HYBRID_SHARD's two-level gradient reduction.

``--impl=student`` grades ``exercises/projects/hybrid/hybrid.py``; ``--impl=reference`` the instructor's solution.

Oracle: torch FSDP1 with ``ShardingStrategy.HYBRID_SHARD`` at 4 ranks, on each rank's own data: its unreduced
gradient (a backward inside ``no_sync()``) is the input, its sharded ``flat_param.grad`` after a normal backward
is the answer.  Two spawns of 4 ranks (``tests/exercises/projects/_workers_hybrid.py``): torch's (no learner code),
then the learner's function on torch's inputs; three cases, three units each (two of them padded), the data drawn
from the grading seed.  Points by test (``@pytest.mark.points``): the shards, the bytes.

* ``2x2-fp32``: bitwise.  torch sums a number as (g0 + g1) + (g2 + g3), the shard group's sum first; an
  all-reduce across replicas first sums (g0 + g2) + (g1 + g3), which differs in the last bits;
* ``2x2-fp16`` and ``4x1-fp16``: bitwise, gradients near fp16's smallest normal number, where each division
  rounds.  torch divides by f = 2 before any sum and by N / f = 2 after; dividing by 4 once, or by the shard
  group's size before and the replicate group's after (4 and 1 in the 4x1 layout), rounds differently.
  Comparing after a cast to fp32 is exact (fp16 -> fp32 loses nothing).
* bytes, exact: ``minifsdp.comm.count_bytes`` counts what the book's ring collectives send; a ring
  reduce-scatter of the padded gradient inside the shard group and a ring all-reduce of the shard across
  replicas send exactly what ``ring_bytes`` computes from the ring's own chunking.
"""

import pytest
import torch

import minifsdp
from tests.exercises import learner_ranks, module_name, outcome_line
from tests.exercises.projects._workers_hybrid import CASES, learner_on_rank, torch_on_rank

PROJECT = "project-hybrid"
UNITS = 3


@pytest.fixture(scope="module")
def ranks(impl, course_seed):
    """Every rank's ``{case: [per unit {"torch", "input", "ring_bytes", "yours", "sent", "modified"}]}``, or the
    learner's failure in one line (a str)."""
    theirs = minifsdp.spawn(torch_on_rank, args=(course_seed,), world_size=4, timeout_s=180)
    inputs = {case: [[u["input"] for u in theirs[r][case]] for r in range(4)] for case in CASES}
    try:
        yours = learner_ranks(learner_on_rank, (module_name("projects.hybrid.hybrid", impl), inputs), 4, 180)
    except AssertionError as e:
        return str(e)
    raised = next((r["raised"] for r in yours if "raised" in r), None)
    if raised is not None:
        return outcome_line({"raised": raised})
    return [{case: [{**t, **y} for t, y in zip(theirs[r][case], yours[r][case], strict=True)] for case in CASES}
            for r in range(4)]


def _units(ranks, case):
    if isinstance(ranks, str):
        pytest.fail(f"{PROJECT}: {ranks}", pytrace=False)
    assert len(ranks) == 4 and all(len(r[case]) == UNITS for r in ranks)
    return [(rank, unit, u) for rank, r in enumerate(ranks) for unit, u in enumerate(r[case])]


@pytest.mark.timeout(480)
@pytest.mark.points(14)
@pytest.mark.parametrize("case", list(CASES))
def test_project_hybrid_shards_bitwise_torch_fsdp1(ranks, case):
    for rank, unit, u in _units(ranks, case):
        where = f"{case}, rank {rank}, unit {unit} ({u['input'].numel()} numbers)"
        got, want = u["yours"], u["torch"]
        assert isinstance(got, torch.Tensor), f"{where}: returned {type(got).__name__}, not a tensor"
        assert not u["modified"], f"{where}: you modified full_grad (the caller's gradient)"
        assert got.dtype == u["input"].dtype, f"{where}: returned {got.dtype}, the input is {u['input'].dtype}"
        assert got.shape == want.shape, (f"{where}: returned shape {tuple(got.shape)}, "
                                         f"torch's shard is {tuple(want.shape)}")
        if u["input"].dtype == torch.float16:  # the case's premise: most numbers where a division rounds
            g = u["input"].float().abs()
            g = g[g > 0]
            assert (g < 2.0 ** -10).float().mean() > 0.5, f"{where}: the gradients are not small"
        wrong = (got.to(want.dtype) != want).sum().item()
        assert wrong == 0, f"{where}: {wrong} of {want.numel()} numbers differ from torch FSDP1 HYBRID_SHARD's shard"


@pytest.mark.timeout(480)
@pytest.mark.points(6)
@pytest.mark.parametrize("case", list(CASES))
def test_project_hybrid_sends_what_the_ring_sends(ranks, case):
    for rank, unit, u in _units(ranks, case):
        assert u["sent"] == u["ring_bytes"], (
            f"{case}, rank {rank}, unit {unit} ({u['input'].numel()} numbers): you sent {u['sent']} bytes through "
            f"the book's ring collectives; a ring reduce-scatter inside the shard group then a ring all-reduce of "
            f"the shard across replicas send {u['ring_bytes']}")
