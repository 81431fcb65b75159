"""What a course grades and for how many points: ``exercises/points.csv``, which task a test grades, the score.

Why a module of its own: every part of the grader reads the same table and raises the same error (``CourseError``),
the command (``course.py``) and the parts it runs (``course_run.py``, ``course_class.py``, ``course_bug.py``,
``course_copy.py``, ...) alike; here, below all of them, none of them imports the command.

What is graded, and for how many points:

    exercises/points.csv   task,points,hours,title: one row per graded task, the one table an instructor edits
                           (ids: ``2.2a`` for a task, ``project-<name>`` for a project, ``bug`` for the lab)
    tests/exercises/       the tests: ``test_task2_2a_...`` grades task 2.2a; a test under
                           ``tests/exercises/projects/`` grades ``project-<name>``, named by its folder
                           (``projects/zero1/``) or its file (``projects/test_zero1.py``); ``_`` reads as ``-``

A task earns its points when every one of its tests passes, and none otherwise, whatever their order; a
project whose tests carry ``@pytest.mark.points(w)`` shares its points among its test functions by weight
(``w`` of the sum; a function earns its share when every case of it passes).  How the tests of a copy run
(one pytest subprocess, ``--impl``, ``--course-task``, ``--course-seed``; its outcomes signed) is
``course_run.py``; a failure is reported in one line.  An untouched stub's is
``task 2.2a not done yet: exercises/ring_collectives.py ring_reduce_scatter``, read from the file, in the
grader's run and in a learner's own ``pytest`` alike (``tests/exercises/conftest.py``).

The grading seed (``check_seed``): 0 <= S < 2**31, so answers written for one run's inputs fail another's.
"""

from __future__ import annotations

import csv
import json
import re
from dataclasses import dataclass
from pathlib import Path

__all__ = ["CourseError", "Row", "read_points", "task_of", "not_done", "failure_line", "score", "shares",
           "check_seed", "graded_rows", "table", "as_json", "POINTS", "OUTCOMES_ENV", "KEY_FD_ENV", "MAX_SEED"]

POINTS = Path("exercises") / "points.csv"
OUTCOMES_ENV = "MINIFSDP_PLANT_OUTCOMES"  # tests/planted_faults/outcomes.py writes the session's outcomes there
KEY_FD_ENV = "MINIFSDP_COURSE_KEY_FD"  # ... and signs them with the key it reads from this pipe
MAX_SEED = 2**31 - 1
PROJECTS = "tests/exercises/projects/"
_TASK_TEST = re.compile(r"test_task(\d+)_(\d+[a-z]?)(?=_|\[|$)")
_STUB_TEXT = re.compile(r"NotImplementedError\W+(?:Task|Project) ([\w.-]+): (\w+)")
_TASK_IN_MESSAGE = re.compile(r"^(?:Task|Project) ([\w.-]+):")


class CourseError(RuntimeError):
    """A course command that cannot run as asked: the message names the problem and the fix."""


@dataclass(frozen=True)
class Row:
    """One row of ``exercises/points.csv``."""

    task: str
    points: int
    hours: float
    title: str


def read_points(root: Path) -> list[Row]:
    """The rows of ``root/exercises/points.csv``, checked: unique ids, whole points, hours as numbers."""
    path = root / POINTS
    if not path.exists():
        raise CourseError(f"{path} is missing: run from the repository root (or its student edition)")
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        if reader.fieldnames != ["task", "points", "hours", "title"]:
            raise CourseError(f"{path}: the header must be task,points,hours,title, got {reader.fieldnames}")
        rows = []
        for n, line in enumerate(reader, start=2):
            try:
                rows.append(Row(line["task"].strip(), int(line["points"]), float(line["hours"]), line["title"].strip()))
            except (TypeError, ValueError) as e:
                raise CourseError(f"{path} line {n}: points must be a whole number and hours a number ({e})") from e
    seen = [r.task for r in rows]
    twice = sorted({t for t in seen if seen.count(t) > 1})
    if twice:
        raise CourseError(f"{path}: tasks listed twice: {', '.join(twice)}")
    return rows


def task_of(nodeid: str, known=()) -> str | None:
    """The graded task a test's node id belongs to (None: not a graded test).  ``known``: the ids of
    points.csv; a project test's file name may go on past its project's id (``test_zero1_steps.py``)."""
    path, _, name = nodeid.partition("::")
    if path.startswith(PROJECTS):
        rest = path[len(PROJECTS):]
        stem = (rest.split("/")[0] if "/" in rest else Path(rest).stem).removeprefix("test_").replace("_", "-")
        ids = [k for k in known if k.startswith("project-") and (stem == k[8:] or stem.startswith(k[8:] + "-"))]
        return max(ids, key=len) if ids else f"project-{stem}"
    m = _TASK_TEST.match(name)
    return f"{m.group(1)}.{m.group(2)}" if m and path.startswith("tests/exercises/") else None


def _stub_file(root: Path, function: str) -> str:
    """The learner's file (under ``exercises/``, not ``solutions/``) that defines ``function``."""
    pattern = re.compile(rf"^\s*def {re.escape(function)}\(", re.M)
    for path in sorted((root / "exercises").rglob("*.py")):
        rel = path.relative_to(root)
        if "solutions" not in rel.parts and pattern.search(path.read_text(errors="replace")):
            return rel.as_posix()
    return "exercises/"


def not_done(task: str, root: Path, excinfo=None, text: str = "") -> str | None:
    """``task 2.2c not done yet: exercises/ring_collectives.py ring_reduce_scatter (task 2.2a)`` when the failure
    is a stub's ``NotImplementedError`` (raised here: ``excinfo``; or quoted from a rank: ``text``), else None."""
    where = inner = None
    if excinfo is not None and excinfo.errisinstance(NotImplementedError):
        for entry in reversed(excinfo.traceback):
            try:
                rel = Path(str(entry.path)).resolve().relative_to(root.resolve())
            except ValueError:
                continue
            if rel.parts[0] == "exercises" and "solutions" not in rel.parts:
                where = f"{rel.as_posix()} {entry.name}"
                break
        m = _TASK_IN_MESSAGE.match(str(excinfo.value))
        inner = m.group(1) if m else None
    if where is None:
        text = text or (str(excinfo.value) if excinfo is not None else "")
        m = _STUB_TEXT.search(text)
        if m is not None:
            inner, function = m.groups()
            where = f"{_stub_file(root, function)} {function}"
        elif "NotImplementedError" in text:  # a stub whose message names no task: quote it
            where = failure_line(text[text.index("NotImplementedError"):].splitlines()[0], 160)
        else:
            return None
    return f"task {task} not done yet: {where}" + (f" (task {inner})" if inner and inner != task else "")


def failure_line(message: str, limit: int = 300) -> str:
    """A test's failure message in one line: no ``AssertionError:`` prefix, whitespace collapsed, cut at ``limit``."""
    text = " ".join(message.replace("AssertionError: ", "", 1).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def check_seed(seed) -> int:
    """A grading seed, or a one-line CourseError: a whole number from 0 to 2**31 - 1."""
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED:
        raise CourseError(f"--seed {seed}: a grading seed is a whole number from 0 to {MAX_SEED}")
    return seed


def shares(points: int, weights: list[float]) -> list[int]:
    """``points`` split by ``weights`` in whole points that add up to ``points`` (the largest remainders round up)."""
    total = sum(weights)
    if total <= 0:
        return [0] * len(weights)
    exact = [points * w / total for w in weights]
    out = [int(x) for x in exact]
    for i in sorted(range(len(weights)), key=lambda i: exact[i] - out[i], reverse=True)[: points - sum(out)]:
        out[i] += 1
    return out


def _function_of(nodeid: str) -> str:
    return nodeid.split("[", 1)[0]


def score(outcomes: dict, rows: list[Row], log: str = "") -> tuple[list[dict], list[str]]:
    """Points per row from the tests' outcomes: ``([{"task", "points", "possible", "failed", "tests"}], stray
    node ids)``.  A row earns its points when it has tests and every one passed, whatever their order; where its
    tests carry points (``@pytest.mark.points``), each test function earns its share when all its cases passed
    (the share of a test that never ran is lost: ``points_total`` weighs them all).
    ``failed``: the first failure's line; ``tests``: every test's node id, outcome and line."""
    known = [r.task for r in rows]
    cases: dict[str, list[dict]] = {}
    stray = []
    for nodeid, outcome in sorted(outcomes.items()):
        task = task_of(nodeid, known)
        if task in known:
            cases.setdefault(task, []).append({**outcome, "test": nodeid})
        elif task is not None:
            stray.append(nodeid)
    tail = [ln for ln in log.strip().splitlines() if ln.strip()][-1:] or ["no output"]
    results = []
    for row in rows:
        mine = cases.get(row.task, [])
        bad = [c for c in mine if c["outcome"] != "passed"]
        if not mine:
            failed = f"no test of task {row.task} ran (pytest said: {failure_line(tail[0], 160)})"
        elif bad:
            kind = bad[0]["outcome"]
            failed = failure_line(("" if kind == "failed" else f"{kind}: ") + bad[0]["message"])
        else:
            failed = ""
        earned = row.points if mine and not bad else 0
        weights = {_function_of(c["test"]): c["points"] for c in mine if c.get("points") is not None}
        if mine and weights:  # partial credit: each test function its share, when every case of it passed
            functions = sorted(weights)
            failing = {_function_of(c["test"]) for c in bad}
            unran = max(c.get("points_total", 0) for c in mine) - sum(weights.values())  # tests that never ran
            split = shares(row.points, [weights[f] for f in functions] + [max(unran, 0)])
            earned = sum(p for f, p in zip(functions, split) if f not in failing)
        results.append({"task": row.task, "points": earned, "possible": row.points, "failed": failed,
                        "tests": [{"test": c["test"], "outcome": c["outcome"],
                                   "line": failure_line(c["message"]) if c["outcome"] != "passed" else ""}
                                  for c in mine]})
    return results, stray


def graded_rows(root: Path, only: list[str] | None) -> list[Row]:
    """The rows of points.csv ``only`` names (all but the bug lab's when None); an unknown id is a CourseError."""
    rows = read_points(root)
    if only is None:
        return [r for r in rows if r.task != "bug"]
    unknown = [t for t in only if t not in {r.task for r in rows}]
    if unknown:
        raise CourseError(f"--task {','.join(unknown)}: not in exercises/points.csv "
                          f"(its tasks: {', '.join(r.task for r in rows)})")
    return [r for r in rows if r.task in only]


def table(results: list[dict]) -> str:
    """The grader's table: task, points earned / possible, the first failure in one line."""
    width = max([len(r["task"]) for r in results] + [4])
    lines = [f"{'task':<{width}}  {'points':^9}  first failure"]
    for r in results:
        failed = r["failed"] if len(r["failed"]) <= 150 else r["failed"][:147] + "..."
        lines.append(f"{r['task']:<{width}}  {r['points']:>3} / {r['possible']:<3}  {failed or 'passed'}")
    earned, possible = sum(r["points"] for r in results), sum(r["possible"] for r in results)
    lines.append(f"{'total':<{width}}  {earned:>3} / {possible}")
    return "\n".join(lines)


def as_json(results: list[dict]) -> str:
    """``{"tasks": [{"task", "points", "possible", "failed", "tests"}, ...], "earned": E, "possible": P}``."""
    return json.dumps({"tasks": results, "earned": sum(r["points"] for r in results),
                       "possible": sum(r["possible"] for r in results)}, indent=1)
