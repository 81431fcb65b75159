"""Grades tasks 2.2a-c (ring collectives): ``exercises/ring_collectives.py`` (``--impl=student``) or the
instructor's answer (the textbook ring), on 3 ranks.

The ranks are the learner's processes: under the tasks' rule (point-to-point messages only: a collective raises
there, ``minifsdp/classroom/course_rules.py``), each rank calls the functions on its own data, for the group of all 3
ranks and for the pair of ranks 0 and 1 (fresh groups per task, with a short timeout: a deadlock fails that task
with gloo's "Timed out waiting ..." and the learner's line, and the next task still runs), and hands back what
it got (``tests/exercises/__init__.py``: ``learner_ranks``).  This process decides.

Oracle: every rank's data, drawn from the grading seed as small integers, so every sum is exact in fp32 whatever
the order of additions; the sums are computed here and compared bitwise.  One spawn grades the three tasks; if a
rank dies or never answers, each task is graded again in a spawn of its own, so one broken task cannot fail
the others.
"""

import importlib

import pytest
import torch
import torch.distributed as dist

from minifsdp.classroom.course_remote import capture, to_bytes
from minifsdp.classroom.course_rules import enforce_here
from tests.exercises import (
    anyone_failed,
    learner_group,
    learner_ranks,
    module_name,
    outcome_line,
    root_causes_first,
)

TASKS = ("2.2a", "2.2b", "2.2c")
GROUPS = {"N=3": [0, 1, 2], "N=2": [0, 1]}
SIZES = (1, 4, 7)


def _data(seed: int, rank: int, numel: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1000 + 100 * rank + numel)
    return torch.randint(-9, 10, (numel,), generator=g).float()


def _cases(task: str, n: int):
    """(label, numel per rank, shape) of each call: m per chunk for 2.2a-b; 2.2c also uneven and 2-D tensors."""
    if task != "2.2c":
        return [(f"m={m}", m, (m,)) for m in SIZES]
    return [(f"shape {s}", k, s) for m in SIZES for k, s in ((m, (m,)), (n * m + 1, (n * m + 1,)), (4 * m, (4, m)))]


def _run_task(mod, task: str, seed: int, groups: dict) -> dict:
    """On one rank: {group: [(label, output or the call's failure, input unchanged)]} for the groups it is in."""
    me, out = dist.get_rank(), {}
    for name, members in GROUPS.items():
        if me not in members:
            if anyone_failed(False):
                break
            continue
        n, r, rows = len(members), members.index(me), []
        for label, numel, shape in _cases(task, n):
            if task == "2.2a":
                given, result = _data(seed, me, n * numel), torch.full((numel,), -1.0)
                sent = given.clone()
                got = capture(mod.ring_reduce_scatter, result, sent, group=groups[name])
            elif task == "2.2b":
                result, given = torch.full((n * numel,), -1.0), _data(seed, me, numel)
                sent = given.clone()
                got = capture(mod.ring_all_gather, result, sent, group=groups[name])
            else:
                given = _data(seed, me, numel).reshape(shape)
                result = sent = given.clone()
                got = capture(mod.ring_all_reduce, result, group=groups[name])
            if "raised" in got:
                rows.append((label, {"raised": got["raised"]}, True))
                break  # this group's later calls would wait for a rank that gave up
            rows.append((label, {"value": result}, task == "2.2c" or torch.equal(sent, given)))
        out[name] = (r, rows)
        if anyone_failed(any("raised" in got for _, got, _ in rows)):
            break  # the next group's calls would wait as long again (a deadlock): one failure says it
    return out


def _failed_first(report: dict, tasks) -> dict | None:
    """The first failure of ``tasks`` in this rank's report so far (2.2c's given code calls 2.2a's and 2.2b's)."""
    return next(({"raised": {**got["raised"], "message": f"task {t} failed first: {got['raised']['message']}"}}
                 for t in tasks if t in report for _, (_, rows) in report[t].items() for _, got, _ in rows
                 if "raised" in got), None)


def grade_on_rank(name: str, tasks: tuple, seed: int) -> bytes:
    enforce_here(TASKS)  # the rule, before the learner's module is imported
    groups = {task: {g: learner_group(members) for g, members in GROUPS.items()} for task in tasks}  # fresh per task
    mod = importlib.import_module(name)
    report = {}
    for task in tasks:
        first = _failed_first(report, ("2.2a", "2.2b")) if task == "2.2c" else None
        if task == "2.2c" and anyone_failed(first is not None) and first is None:  # every rank agrees
            first = {"raised": {"type": "RuntimeError", "where": "", "message": "task 2.2a or 2.2b failed first on "
                                                                               "another rank"}}
        if first is not None:  # it would fail the same way (a deadlock: wait as long again): say so at once
            report[task] = {g: (GROUPS[g].index(dist.get_rank()), [("built on", first, True)])
                            for g in GROUPS if dist.get_rank() in GROUPS[g]}
            continue
        report[task] = _run_task(mod, task, seed, groups[task])
    return to_bytes(report)


def _want(task: str, seed: int, members: list, r: int, numel: int, shape) -> torch.Tensor:
    n = len(members)
    if task == "2.2a":
        return sum(_data(seed, g, n * numel) for g in members)[r * numel:(r + 1) * numel]
    if task == "2.2b":
        return torch.cat([_data(seed, g, numel) for g in members])
    return sum(_data(seed, g, numel) for g in members).reshape(shape)


@pytest.fixture(scope="module")
def graded_together(impl, course_seed):
    """Every task in one spawn, or the line saying why that spawn failed (then each task gets its own)."""
    try:
        return learner_ranks(grade_on_rank, (module_name("ring_collectives", impl), TASKS, course_seed), 3, 60)
    except AssertionError as e:
        return str(e)


def _check(task: str, ranks: list, seed: int) -> None:
    fails = []
    for rank, report in enumerate(ranks):
        for name, (r, rows) in report[task].items():
            members = GROUPS[name]
            for label, got, unchanged in rows:
                if "raised" in got:
                    fails.append(f"rank {rank}, {name}, {label}: {outcome_line(got)}")
                    continue
                numel, shape = next((k, s) for lab, k, s in _cases(task, len(members)) if lab == label)
                want = _want(task, seed, members, r, numel, shape)
                if not torch.equal(got["value"], want):
                    fails.append(f"rank {rank}, {name}, {label}: got {got['value'].reshape(-1)[:8].tolist()}, want "
                                 f"{want.reshape(-1)[:8].tolist()}")
                if not unchanged:
                    fails.append(f"rank {rank}, {name}, {label}: the input was modified")
            if len(rows) != len(_cases(task, len(members))) and not any("raised" in g for _, g, _ in rows):
                fails.append(f"rank {rank}, {name}: {len(rows)} results, want {len(_cases(task, len(members)))}")
    assert not fails, f"Task {task} is not right yet: " + "; ".join(root_causes_first(fails)[:6])


def _grade(impl: str, task: str, graded_together, seed: int) -> None:
    if isinstance(graded_together, str):  # a rank died or hung: this task alone
        ranks = learner_ranks(grade_on_rank, (module_name("ring_collectives", impl), (task,), seed), 3, 60)
    else:
        ranks = graded_together
    _check(task, ranks, seed)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("task", ["2.2a"])  # `-k 2.2a` selects it
def test_task2_2a_ring_reduce_scatter(impl, task, graded_together, course_seed):
    _grade(impl, task, graded_together, course_seed)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("task", ["2.2b"])  # `-k 2.2b` selects it
def test_task2_2b_ring_all_gather(impl, task, graded_together, course_seed):
    _grade(impl, task, graded_together, course_seed)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("task", ["2.2c"])  # `-k 2.2c` selects it
def test_task2_2c_ring_all_reduce(impl, task, graded_together, course_seed):
    _grade(impl, task, graded_together, course_seed)
