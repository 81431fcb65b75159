"""Grades tasks 2.2a-c (ring collectives): the module ``impl_module("ring_collectives", impl)`` gives, the
stubs in exercises/ring_collectives.py (``--impl=student``) or the instructor's answer (the textbook ring).

Ranks: 3, world size 3 is the default group, world size 2 the subgroup of ranks 0 and 1.
One spawn grades all three tasks (a spawn costs seconds); a task that raises
NotImplementedError is recorded as failing and the next task is graded (a stub raises on
every rank before any message, so no rank is left waiting).  If anything else goes wrong
(a rank crashes, hangs, or raises something else) every task is graded again in its own
spawn, so one broken task cannot fail the others.  The worker imports the implementation
by module name (a string pickles to the ranks).
Oracle: small-integer data, so every sum is exact in fp32 whatever the order of additions;
each rank rebuilds every rank's data from its seed and compares bitwise.
"""

import importlib

import pytest
import torch
import torch.distributed as dist

import minifsdp
from minifsdp.launch import RankFailedError
from tests.exercises import impl_module

TASKS = ("2.2a", "2.2b", "2.2c")


def _data(rank: int, numel: int) -> torch.Tensor:
    return torch.randint(-9, 10, (numel,), generator=torch.Generator().manual_seed(100 * rank + numel)).float()


def _grade(module_name: str, task: str) -> list[str]:
    """Runs on every rank; returns what went wrong (empty list: the task passes)."""
    mod = importlib.import_module(module_name)
    me, fails = dist.get_rank(), []
    pair = dist.new_group([0, 1])  # every rank must create it, members or not
    for group, members in ((None, [0, 1, 2]), (pair, [0, 1])):
        if me not in members:
            continue
        n, r = len(members), members.index(me)
        for m in (1, 4, 7):
            where = f"N={n} m={m}"
            total = sum(_data(g, n * m) for g in members)
            if task == "2.2a":
                inp = _data(me, n * m)
                before = inp.clone()
                out = torch.full((m,), -1.0)
                mod.ring_reduce_scatter(out, inp, group=group)
                if not torch.equal(out, total[r * m : (r + 1) * m]):
                    fails.append(f"{where}: rank {r} got {out.tolist()}, want chunk {r} of the sum "
                                 f"{total[r * m : (r + 1) * m].tolist()}")
                if not torch.equal(inp, before):
                    fails.append(f"{where}: input was modified")
            elif task == "2.2b":
                out = torch.full((n * m,), -1.0)
                mod.ring_all_gather(out, _data(me, m), group=group)
                want = torch.cat([_data(g, m) for g in members])
                if not torch.equal(out, want):
                    fails.append(f"{where}: got {out.tolist()}, want {want.tolist()}")
            else:
                for numel, shape in ((m, (m,)), (n * m + 1, (n * m + 1,)), (4 * m, (4, m))):
                    t = _data(me, numel).reshape(shape)
                    mod.ring_all_reduce(t, group=group)
                    want = sum(_data(g, numel) for g in members).reshape(shape)
                    if not torch.equal(t, want):
                        fails.append(f"N={n} numel={numel}: got {t.reshape(-1)[:6].tolist()}..., "
                                     f"want {want.reshape(-1)[:6].tolist()}...")
    return fails


def _grade_all(module_name: str) -> dict[str, list[str]]:
    report = {}
    for task in TASKS:
        try:
            report[task] = _grade(module_name, task)
        except NotImplementedError as e:
            report[task] = [f"NotImplementedError: {e}"]
    return report


def _failures(results, task) -> list[str]:
    return [f"rank {r}: {line}" for r, report in enumerate(results) for line in report[task]]


def _module_name(impl: str) -> str:
    return impl_module("ring_collectives", impl).__name__


@pytest.fixture(scope="module")
def graded_together(impl):
    """Every task in one spawn, or None if that spawn failed (then each task gets its own)."""
    try:
        return minifsdp.spawn(_grade_all, args=(_module_name(impl),), world_size=3, timeout_s=30)
    except RankFailedError:
        return None


def _run(impl: str, task: str, graded_together) -> None:
    if graded_together is not None:
        fails = _failures(graded_together, task)
    else:
        results = minifsdp.spawn(_grade, args=(_module_name(impl), task), world_size=3, timeout_s=30)
        fails = [f"rank {r}: {line}" for r, lines in enumerate(results) for line in lines]
    assert not fails, f"Task {task} is not right yet:\n" + "\n".join(fails[:10])


@pytest.mark.timeout(90)
@pytest.mark.parametrize("task", ["2.2a"])
def test_task2_2a_ring_reduce_scatter(impl, task, graded_together):
    _run(impl, task, graded_together)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("task", ["2.2b"])
def test_task2_2b_ring_all_gather(impl, task, graded_together):
    _run(impl, task, graded_together)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("task", ["2.2c"])
def test_task2_2c_ring_all_reduce(impl, task, graded_together):
    _run(impl, task, graded_together)
