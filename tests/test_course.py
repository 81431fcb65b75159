"""The grader's parts, in one process (``minifsdp/classroom/``): the points table, which task a test
grades, a failure in one line, points from outcomes (every test of a task, in any order; a project's share per
test), the table, the JSON and the feedback a class reads, the rules read from a learner's file, the files the
grader takes from a copy, and bad input refused in one line.

The grader run itself, both ways (the instructor's answers earn every point, untouched stubs none) and the cheats
a class finds, is ``tests/test_exercise_grading.py``.
"""

import contextlib
import io
import itertools
import json
import re
from pathlib import Path

import pytest

from minifsdp.classroom.course_class import feedback, students
from minifsdp.classroom.course_rules import LEARNER_FILES, check_source, stubs_left
from minifsdp.classroom.points import Row, as_json, failure_line, not_done, read_points, score, shares, table, task_of
from minifsdp.commands.cli import main

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests" / "exercises"


def _graded_test_ids() -> list[str]:
    """Every test function under tests/exercises/, as a node id (read from the files: no collection)."""
    ids = []
    for path in sorted(TESTS.rglob("test_*.py")):
        rel = path.relative_to(ROOT).as_posix()
        ids += [f"{rel}::{name}" for name in re.findall(r"^(?:async )?def (test_\w+)", path.read_text(), re.M)]
    return ids


def test_every_graded_test_has_a_row_and_every_row_has_tests():
    rows = read_points(ROOT)
    known = [r.task for r in rows]
    ids = _graded_test_ids()
    assert len(ids) >= 25, ids  # the files were read
    tasks = {task_of(i, known) for i in ids}
    assert None not in tasks, [i for i in ids if task_of(i, known) is None]
    assert tasks - set(known) == set(), f"tests of tasks points.csv does not list: {sorted(tasks - set(known))}"
    untested = [t for t in known if t not in tasks and t != "bug"]
    assert not untested, f"rows of exercises/points.csv no test grades: {untested}"
    assert "bug" in known
    assert all(r.points > 0 and r.hours > 0 and r.title for r in rows), rows


def test_each_task_of_the_exercise_table_is_graded_with_points():
    """exercises/README.md's table (22 rows; 2.3a-b, 4.1a-b and 5.1-5.2 share one) and points.csv agree."""
    table_text = (ROOT / "exercises" / "README.md").read_text()
    known = {r.task for r in read_points(ROOT)}
    for m in re.finditer(r"^\| (\d\.\d[a-c]?)(?:-(\d\.\d|[a-c]))? ", table_text, re.M):
        first, last = m.groups()
        assert first in known, first
        if last:
            assert (last if "." in last else first[:-1] + last) in known, m.group(0)


@pytest.mark.parametrize("nodeid, task", [
    ("tests/exercises/test_ring_exercises.py::test_task2_2a_ring_reduce_scatter[2.2a]", "2.2a"),
    ("tests/exercises/test_overlap_exercises.py::test_task2_5_prefetch_target", "2.5"),
    ("tests/exercises/test_config_exercises.py::test_task2_5b_corrected_fsdp_call", "2.5b"),
    ("tests/exercises/test_ddp_exercises.py::test_task1_1_examples[numels0-800-expected0]", "1.1"),
    ("tests/exercises/projects/test_zero1.py::test_losses", "project-zero1"),
    ("tests/exercises/projects/test_noshard_accum_bytes.py::test_x", "project-noshard-accum"),
    ("tests/exercises/projects/ac_budget/test_policy.py::test_x", "project-ac-budget"),
    ("tests/test_layout.py::test_task2_2a_lookalike", None),
    ("tests/exercises/test_ring_exercises.py::_grade", None),
])
def test_which_task_a_test_grades(nodeid, task):
    known = ["2.2a", "project-zero1", "project-noshard-accum", "project-ac-budget"]
    assert task_of(nodeid, known) == task


def test_a_stub_quoted_by_a_rank_reads_as_one_line():
    text = ("Task 2.2c is not right yet:\nrank 0: NotImplementedError: Task 2.2a: ring_reduce_scatter -- see "
            "exercises/README_ring.md\nrank 1: ...")
    assert not_done("2.2c", ROOT, text=text) == \
        "task 2.2c not done yet: exercises/ring_collectives.py ring_reduce_scatter (task 2.2a)"
    assert not_done("9.9", ROOT, text="NotImplementedError: write step() first\n  more") == \
        "task 9.9 not done yet: NotImplementedError: write step() first"
    assert not_done("2.2a", ROOT, text="AssertionError: rank 0 got [1.0], want [2.0]") is None
    assert failure_line("AssertionError: Task 2.1b is not right yet:\n  rank 0: N=3 differs") == \
        "Task 2.1b is not right yet: rank 0: N=3 differs"
    assert len(failure_line("x" * 1000)) == 300


def test_points_come_from_every_test_of_a_task_passing():
    rows = [Row("1.1", 2, 1.0, "a"), Row("2.2a", 4, 2.0, "b"), Row("4.2", 2, 1.0, "c"), Row("5.1", 3, 1.5, "d")]
    ok, no = {"outcome": "passed", "message": ""}, {"outcome": "failed", "message": "AssertionError: no"}
    outcomes = {
        "tests/exercises/test_ddp_exercises.py::test_task1_1_examples[a]": ok,
        "tests/exercises/test_ddp_exercises.py::test_task1_1_examples[b]": ok,
        "tests/exercises/test_ring_exercises.py::test_task2_2a_x": ok,
        "tests/exercises/test_ring_exercises.py::test_task2_2a_y": no,
        "tests/exercises/test_hf_exercises.py::test_task4_2_x": {"outcome": "skipped", "message": "no transformers"},
        "tests/exercises/projects/test_nope.py::test_x": ok,
    }
    results, stray = score(outcomes, rows, log="1 failed in 3.0s")
    by = {r["task"]: r for r in results}
    assert [r["task"] for r in results] == ["1.1", "2.2a", "4.2", "5.1"]
    assert {k: v for k, v in by["1.1"].items() if k != "tests"} == {"task": "1.1", "points": 2, "possible": 2,
                                                                    "failed": ""}
    assert [t["test"][-3:] for t in by["1.1"]["tests"]] == ["[a]", "[b]"]
    assert by["2.2a"]["points"] == 0 and by["2.2a"]["failed"] == "no"
    assert by["4.2"]["points"] == 0 and by["4.2"]["failed"] == "skipped: no transformers"
    assert by["5.1"]["points"] == 0 and "no test of task 5.1 ran" in by["5.1"]["failed"]
    assert stray == ["tests/exercises/projects/test_nope.py::test_x"]
    doc = json.loads(as_json(results))
    assert list(doc) == ["tasks", "earned", "possible"] and (doc["earned"], doc["possible"]) == (2, 11)
    assert all(list(t) == ["task", "points", "possible", "failed", "tests"] for t in doc["tasks"])
    text = table(results)
    assert text.splitlines()[1].split()[:4] == ["1.1", "2", "/", "2"] and "passed" in text.splitlines()[1]
    assert text.splitlines()[-1].split() == ["total", "2", "/", "11"]


OK, NO = {"outcome": "passed", "message": ""}, {"outcome": "failed", "message": "AssertionError: rank 1 differs"}


@pytest.mark.parametrize("order", list(itertools.permutations(range(3))))
def test_a_task_earns_its_points_only_when_every_test_passes_in_any_order(order):
    """The failing test first, in the middle or last: the task earns nothing, and says why."""
    rows = [Row("2.2a", 4, 2.0, "ring")]
    cases = [("tests/exercises/test_ring_exercises.py::test_task2_2a_x[2.2a]", NO),
             ("tests/exercises/test_ring_exercises.py::test_task2_2a_y", OK),
             ("tests/exercises/test_ring_exercises.py::test_task2_2a_z", OK)]
    results, _ = score(dict(cases[i] for i in order), rows)
    assert results[0]["points"] == 0 and results[0]["failed"] == "rank 1 differs", results
    assert score(dict(cases[i] for i in order if i), rows)[0][0]["points"] == 4


def test_a_project_shares_its_points_among_its_tests():
    """ZeRO-1 (30 points, weights 12 / 10 / 8): numbers right at both world sizes but too much memory kept earns
    22; a function with several cases earns its share only when every case passes; the shares add up exactly."""
    rows = [Row("project-zero1", 30, 6.0, "zero1")]
    base = "tests/exercises/projects/test_zero1.py::test_project_zero1_"
    outcomes = {f"{base}bitwise": {**OK, "points": 12}, f"{base}close": {**OK, "points": 10},
                f"{base}keeps_a_shard[pair]": {**NO, "points": 8}, f"{base}keeps_a_shard[world]": {**OK, "points": 8}}
    result = score(outcomes, rows)[0][0]
    assert (result["points"], result["failed"]) == (22, "rank 1 differs"), result
    assert [t["outcome"] for t in result["tests"]] == ["passed", "passed", "failed", "passed"]
    assert score({k: {**v, **OK} for k, v in outcomes.items()}, rows)[0][0]["points"] == 30
    ran_one = {f"{base}bitwise": {**OK, "points": 12, "points_total": 30}}  # the run stopped after one test
    assert score(ran_one, rows)[0][0]["points"] == 12
    assert shares(30, [12, 10, 8]) == [12, 10, 8] and shares(20, [1, 1, 1]) == [7, 7, 6] and sum(shares(7, [3, 3])) == 7


def test_every_test_of_a_project_carries_a_weight_and_tasks_none():
    """A project's points are shared by the weights of all its test functions; a task earns all or nothing."""
    for path in sorted(TESTS.rglob("test_*.py")):
        text = path.read_text()
        marked = re.findall(r"@pytest\.mark\.points\((\d+)\)", text)
        functions = re.findall(r"^def (test_\w+)", text, re.M)
        if path.parent.name != "projects":
            assert not marked, f"{path.name}: a task earns all its points or none"
            continue
        assert len(marked) == len(functions), f"{path.name}: {len(marked)} weights for {len(functions)} tests"


def test_the_feedback_names_each_failing_test_and_its_line():
    rows = [Row("2.2b", 3, 1.5, "ring"), Row("1.3", 4, 0.5, "slices")]
    outcomes = {"tests/exercises/test_ring_exercises.py::test_task2_2b_ring_all_gather[2.2b]":
                {"outcome": "failed", "message": "Task 2.2b is not right yet: rank 0, N=3, m=1: exercises/ring_"
                 "collectives.py:9 in ring_all_gather: RuntimeError: Timed out waiting 15000ms"},
                "tests/exercises/test_launch_exercises.py::test_task1_3_x": OK}
    text = feedback("alice", score(outcomes, rows)[0], 5)
    assert text.startswith("# Feedback for alice\n\n4 / 7 points (grading seed 5).")
    assert "## 2.2b: 0 / 3" in text and "ring_collectives.py:9 in ring_all_gather" in text and "## 1.3" not in text


def test_the_rules_read_from_a_learners_file():
    """Each rule on the file it guards, and Python's escape hatches on every learner file; the answers obey them."""
    ring = "import torch.distributed as dist\ndef ring_all_gather(o, i, group=None):\n" \
           "    dist.all_gather_into_tensor(o, i, group=group)\n"
    assert check_source(ring, ("2.2a", "2.2b", "2.2c"), "r.py")[0].startswith("r.py:3: `dist.all_gather_into_tensor`: "
                                                                            "rule of task 2.2a/2.2b/2.2c")
    assert check_source(ring, ("2.1b",), "f.py") == []  # 2.1b reduce-scatters with torch's collective, as asked
    sampler = "from torch.utils.data import DistributedSampler as S\n"
    assert "rule of task 1.3" in check_source(sampler, ("1.3",))[0]
    zero = "import torch.distributed.optim\n"
    assert "rule of task project-zero1" in " ".join(check_source(zero, ("project-zero1",)))
    env = "def test_catches_the_planted_fault():\n    assert 'MINIFSDP_PLANT_FAULT' not in torch.os.environ\n"
    flagged = " ".join(check_source(env, ("5.3",)))
    assert all(f in flagged for f in ("'MINIFSDP_PLANT_FAULT'", "`.os`", "`.environ`", "rule of task 5.3")), flagged
    for hatch in ("eval('1')", "open('x')", "f.__globals__", "getattr(dist, name)", "import subprocess",
                  "operator.attrgetter('ring_reduce_scatter.__wrapped__')(ring)", "from operator import attrgetter",
                  "torch.ones(1).numpy().tofile('tests/x.py')", "torch.save(1, 'tests/x.py')",
                  "from torch.utils import cpp_extension", "import torch.utils.cpp_extension", "from torch import save",
                  "from tests.exercises import impl_module", "import exercises." + "solutions"):  # (split: no path)
        assert check_source(hatch + "\n", ("1.1",)), hatch
    assert check_source("from functools import reduce\nx = reduce(max, [1])\n", ("2.2a",)) == []
    imported = "from minifsdp.comm.ring import ring_reduce_scatter  # noqa: F401\n"
    said = check_source(imported, ("2.2a",))[0]
    assert "rule of task 2.2a: the library's minifsdp.comm.ring.ring_reduce_scatter" in said, said
    reached = "import minifsdp.memory.zero_formulas as z\ndef f(n, w, s):\n    return z.model_state_bytes(n, w, s)\n"
    assert "`z.model_state_bytes`: rule of task 2.3a" in check_source(reached, ("2.3a",))[0]
    own = "def ring_reduce_scatter(o, i, group=None):\n    pass\ndef ring_all_reduce(t, group=None):\n" \
          "    ring_reduce_scatter(t, t, group)\n"
    assert check_source(own, ("2.2a", "2.2c")) == []  # the learner's own function of the same name is theirs
    assert check_source(imported, ("project-hybrid",)) == []  # a project built on the ring may use the library's
    for rel, tasks in LEARNER_FILES.items():  # the stubs, and the answers where they are (not in the student edition)
        for where in (ROOT / rel, ROOT / "exercises" / "solutions" / rel.removeprefix("exercises/")):
            assert not where.exists() or check_source(where.read_text(), tasks, str(where)) == [], where
    assert stubs_left((ROOT / "exercises" / "ring_collectives.py").read_text(), "2.2a") == ["ring_reduce_scatter"]


def test_the_learner_files_are_the_stub_modules_and_hold_every_task():
    """What the grader takes from a student's copy is exactly the files with stubs, and each task is in one."""
    stubs = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "exercises").rglob("*.py")
                   if "solutions" not in p.parts and "NotImplementedError" in p.read_text())
    assert sorted(LEARNER_FILES) == stubs
    held = [t for tasks in LEARNER_FILES.values() for t in tasks]
    assert sorted(held) == sorted(r.task for r in read_points(ROOT) if r.task != "bug")


def _cli(*argv) -> tuple[int, str]:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
        rc = main(list(argv))
    return rc, buf.getvalue()


def test_bad_input_is_one_clear_line(tmp_path):
    for argv, said in ((("--task", "9.9"), "--task 9.9: not in exercises/points.csv"),
                       (("--task", "bug"), "--dir DIR"),
                       (("--task", ""), "names no task"), (("--task", " , "), "names no task"),
                       (("--seed", "-1"), "a grading seed is a whole number from 0 to"),
                       (("--seed", str(2**64)), "a grading seed is a whole number from 0 to"),
                       (("--submissions", str(tmp_path / "nowhere")), "no such folder"),
                       (("--submissions", str(tmp_path)), "no sub-folders")):
        rc, text = _cli("course", "grade", *argv)
        assert rc == 2 and said in text and "Traceback" not in text and len(text.strip().splitlines()) <= 2, (
            argv, text)


def test_a_class_folder_holds_students_not_hidden_folders(tmp_path):
    for name in ("bob", "alice", "__MACOSX", ".git", "__pycache__"):
        (tmp_path / name).mkdir()
    (tmp_path / "notes.txt").write_text("not a folder")
    assert [p.name for p in students(tmp_path)] == ["alice", "bob"]
    (tmp_path / "grades.csv").write_text("student\n")
    rc, text = _cli("course", "grade", "--submissions", str(tmp_path), "--seed", "1")
    assert rc == 2 and "--force" in text and (tmp_path / "grades.csv").read_text() == "student\n", text


def test_a_bad_points_table_is_refused(tmp_path):
    (tmp_path / "exercises").mkdir()
    (tmp_path / "exercises" / "points.csv").write_text("task,points,hours,title\n1.1,two,1,x\n")
    with pytest.raises(Exception, match="points must be a whole number"):
        read_points(tmp_path)
    (tmp_path / "exercises" / "points.csv").write_text("task,points,hours,title\n1.1,2,1,x\n1.1,3,1,y\n")
    with pytest.raises(Exception, match="tasks listed twice: 1.1"):
        read_points(tmp_path)
