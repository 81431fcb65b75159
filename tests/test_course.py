"""The grader's parts, in one process (``minifsdp/tools/course.py``): the points table, which task a test
grades, a failure in one line, points from outcomes, the table and the JSON a learning platform reads.

The grader run itself, both ways (the instructor's answers earn every point, untouched stubs none) is
``tests/test_exercise_grading.py``.
"""

import contextlib
import io
import json
import re
from pathlib import Path

import pytest

from minifsdp.tools.cli import main
from minifsdp.tools.course import Row, as_json, failure_line, not_done, read_points, score, table, task_of

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
    assert by["1.1"] == {"task": "1.1", "points": 2, "possible": 2, "failed": ""}
    assert by["2.2a"]["points"] == 0 and by["2.2a"]["failed"] == "no"
    assert by["4.2"]["points"] == 0 and by["4.2"]["failed"] == "skipped: no transformers"
    assert by["5.1"]["points"] == 0 and "no test of task 5.1 ran" in by["5.1"]["failed"]
    assert stray == ["tests/exercises/projects/test_nope.py::test_x"]
    doc = json.loads(as_json(results))
    assert list(doc) == ["tasks", "earned", "possible"] and (doc["earned"], doc["possible"]) == (2, 11)
    assert all(list(t) == ["task", "points", "possible", "failed"] for t in doc["tasks"])
    text = table(results)
    assert text.splitlines()[1].split()[:4] == ["1.1", "2", "/", "2"] and "passed" in text.splitlines()[1]
    assert text.splitlines()[-1].split() == ["total", "2", "/", "11"]


def _cli(*argv) -> tuple[int, str]:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
        rc = main(list(argv))
    return rc, buf.getvalue()


def test_bad_input_is_one_clear_line():
    rc, text = _cli("course", "grade", "--task", "9.9")
    assert rc == 2 and "--task 9.9: not in exercises/points.csv" in text and "Traceback" not in text
    rc, text = _cli("course", "grade", "--task", "bug")
    assert rc == 2 and "--dir DIR" in text


def test_a_bad_points_table_is_refused(tmp_path):
    (tmp_path / "exercises").mkdir()
    (tmp_path / "exercises" / "points.csv").write_text("task,points,hours,title\n1.1,two,1,x\n")
    with pytest.raises(Exception, match="points must be a whole number"):
        read_points(tmp_path)
    (tmp_path / "exercises" / "points.csv").write_text("task,points,hours,title\n1.1,2,1,x\n1.1,3,1,y\n")
    with pytest.raises(Exception, match="tasks listed twice: 1.1"):
        read_points(tmp_path)
