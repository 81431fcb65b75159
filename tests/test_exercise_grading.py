"""The grading works both ways, in the repository and in the student edition handed to a class.

* The repository earns every point: the instructor's answers (``--impl=reference``) pass every graded
  test.  The README's test command already runs ``tests/exercises`` that way, earlier in the same session
  (the folder sorts before this file), and ``tests/conftest.py`` records each outcome: those outcomes are
  scored, not run again.  Run alone, this file runs them once, through the grader.
* The student edition (``python -m minifsdp course student-copy``, built here from this checkout) is graded
  as ``course grade --submissions`` grades a class, with this repository's tests and points:
  its untouched stubs earn no point, each failing in one line (no traceback); the answers copied over the
  stubs (``exercises/solutions/X.py`` -> ``exercises/X.py``) earn every task's point.  The projects'
  answers are not run a second time: that copying them gives a module their tests grade like the
  reference is shown by construction (``tests/test_exercise_solutions.py``: same names, importing only
  the library and torch), and the reference direction above runs their tests.
* In the student edition the README's test command skips the task tests (untouched stubs fail no run)
  and its layout checks pass (module map, named files): checked by running them there.

The student edition leaves the answers out, so there this file has nothing to grade and skips.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from minifsdp.tools.course import grade, grade_submissions, read_points, score
from tests._student_edition import student_edition
from tests.planted_faults.outcomes import SESSION

ROOT = Path(__file__).resolve().parents[1]
SOLUTIONS = ROOT / "exercises" / "solutions"
pytestmark = pytest.mark.skipif(not SOLUTIONS.is_dir(), reason="the student edition: the answers are left out, "
                                "`python -m minifsdp course grade` grades yours")


def _rows():
    return [r for r in read_points(ROOT) if r.task != "bug"]


@pytest.mark.timeout(900)
def test_the_repository_earns_every_point(request):
    rows = _rows()
    this_session_graded_the_reference = request.config.getoption("--impl") in (None, "reference")
    graded = {k: v for k, v in SESSION.items() if k.startswith("tests/exercises/")} \
        if this_session_graded_the_reference else {}
    results, _ = score(graded, rows)
    missing = [r["task"] for r in results if r["failed"].startswith("no test of task")]
    if missing:  # not run in this session (this file alone, or a selection): run those tasks' tests once
        results, _ = grade(ROOT, "reference", missing)
        results += [r for r in score(graded, rows)[0] if r["task"] not in missing]
    short = [f"{r['task']}: {r['failed']}" for r in results if r["points"] != r["possible"]]
    assert not short, "the instructor's answers miss points:\n" + "\n".join(short)
    assert sum(r["points"] for r in results) == sum(r.points for r in rows)


@pytest.fixture(scope="module")
def edition(tmp_path_factory):
    """The student edition of this checkout, as a class would get it (built once per session)."""
    return student_edition(tmp_path_factory)


@pytest.mark.timeout(900)
def test_a_class_of_untouched_stubs_and_copied_answers(edition, tmp_path):
    """Copies of the student edition graded as a class: untouched (every task and project), and with the
    answers copied in (the tasks)."""
    untouched, answered = tmp_path / "class1" / "untouched", tmp_path / "class2" / "answered"
    for where in (untouched, answered):
        shutil.copytree(edition, where, ignore=shutil.ignore_patterns(".git"))
    copied = 0
    for src in SOLUTIONS.rglob("*.py"):
        rel = src.relative_to(SOLUTIONS)
        if rel.name != "__init__.py" and (answered / "exercises" / rel).exists():
            shutil.copy2(src, answered / "exercises" / rel)
            copied += 1
    assert copied >= 11, copied

    everything = [r.task for r in _rows()]
    csv_path, results = grade_submissions(ROOT, untouched.parent, None)
    stubs = results["untouched"]
    assert [r["task"] for r in stubs] == everything
    earned = [f"{r['task']}: {r['points']}" for r in stubs if r["points"]]
    assert not earned, f"untouched stubs earn points, so these tasks grade nothing: {earned}"
    for r in stubs:
        assert r["failed"].startswith(f"task {r['task']} not done yet: "), r
        assert "\n" not in r["failed"] and "Traceback" not in r["failed"], r
    lines = csv_path.read_text().splitlines()
    assert lines[0].split(",")[:2] == ["student", everything[0]] and len(lines) == 2
    assert lines[1].startswith("untouched,") and f",0,{sum(r.points for r in _rows())}," in lines[1], lines[1]

    tasks = [t for t in everything if not t.startswith("project-")]
    csv_path, results = grade_submissions(ROOT, answered.parent, tmp_path / "grades.csv", only=tasks)
    short = [f"{r['task']}: {r['failed']}" for r in results["answered"] if r["points"] != r["possible"]]
    assert not short, "the answers copied into the student edition miss points:\n" + "\n".join(short)
    points = [r.points for r in _rows() if r.task in tasks]
    row = ",".join(map(str, ["answered", *points, sum(points), sum(points)]))
    assert csv_path.read_text().splitlines()[1].startswith(row + ","), csv_path.read_text()


@pytest.mark.timeout(600)
def test_the_student_editions_own_test_command_passes_on_untouched_stubs(edition):
    assert not (edition / "exercises" / "solutions").exists()
    assert subprocess.run(["git", "-C", str(edition), "rev-list", "--count", "HEAD"], capture_output=True,
                          text=True).stdout.strip() == "1"
    env = dict(os.environ, PYTHONPATH=str(edition), PYTEST_DISABLE_PLUGIN_AUTOLOAD="1")
    env.pop("MINIFSDP_PLANT_OUTCOMES", None)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs",
                           "tests/exercises", "tests/test_layout.py", "tests/test_course.py",
                           "tests/test_exercise_grading.py"],
                          cwd=edition, env=env, capture_output=True, text=True)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "the student edition: task tests grade your code" in out, out[-3000:]
    assert " failed" not in out.splitlines()[-1] and " skipped" in out.splitlines()[-1], out[-500:]
    # the edition's graded tests are this repository's, byte for byte: grading a class with this repository's
    # tests (as above) is grading each copy with its own
    ours = {p.relative_to(ROOT) for p in (ROOT / "tests" / "exercises").rglob("*.py")}
    theirs = {p.relative_to(edition) for p in (edition / "tests" / "exercises").rglob("*.py")}
    assert ours == theirs and all((ROOT / p).read_bytes() == (edition / p).read_bytes() for p in ours)
