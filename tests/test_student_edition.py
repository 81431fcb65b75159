"""The student edition holds no answer, runs the student's code where the library's was cut, and tells them the
course's logistics (the student edition leaves this file out: it reads the answers).

Oracles: the answers themselves (``exercises/solutions/`` and the library's marked regions, line by line: none
may survive in any file of the copy, test helpers included, and the check must find one planted there); the
copy's own library and tests, run in a subprocess of the copy, for what the pasted answers earn there; the guide
and ``exercises/points.csv`` for ``SYLLABUS.md``.  The edition is built once per session
(``tests/_student_edition.py``, shared with ``tests/test_exercise_grading.py``).
"""

import ast
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from minifsdp.classroom.course_copy import INSTRUCTOR_ONLY
from minifsdp.classroom.course_cut import cut_source, find_cuts, graded_bodies, surviving_answers
from minifsdp.classroom.course_rules import ANSWERED_BY
from minifsdp.classroom.course_syllabus import GUIDE, schedule, syllabus
from minifsdp.classroom.points import CourseError, read_points
from tests._student_edition import student_edition

ROOT = Path(__file__).resolve().parents[1]
SOLUTIONS = ROOT / "exercises" / "solutions"
# the graded tests that need no ranks, of the tasks whose library function the edition cuts, and the library's
# own tests of those functions: in the copy, with the answers pasted, they all run the pasted code
IN_THE_COPY = ["tests/exercises/test_practice_exercises.py", "tests/exercises/test_checkpoint_exercises.py",
               "tests/exercises/test_parallel_exercises.py", "tests/comm/test_ring_in_one_process.py",
               "tests/test_plan_real_scale.py::test_padding_where_no_world_size_divides",
               "tests/test_pipelining.py::test_simulated_bubble_is_the_formula"]


@pytest.fixture(scope="module")
def edition(tmp_path_factory):
    return student_edition(tmp_path_factory)


def _run(where: Path, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(where), PYTEST_DISABLE_PLUGIN_AUTOLOAD="1")
    for name in ("MINIFSDP_PLANT_OUTCOMES", "MINIFSDP_PLANT_FAULT"):
        env.pop(name, None)
    return subprocess.run([sys.executable, *args], cwd=where, env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_no_answer_survives_in_the_student_edition(edition, tmp_path):
    answers = graded_bodies(ROOT)
    tasks = {re.search(r"Task (\S+?):", ast.unparse(n)).group(1) for n in ast.walk(ast.parse(
        "\n".join(p.read_text() for p in (ROOT / "exercises").glob("*.py")))) if isinstance(n, ast.Raise)
        and "Task " in ast.unparse(n)}
    assert len(answers) >= 40 and len(tasks) >= 25, (len(answers), sorted(tasks))  # every answer was read
    # building the edition ran the same check over every file of it (student_copy refuses a copy that fails it)
    # and it holds no instructor-only file: the guide, the answers, the bug lab's catalog and its faults, ...
    assert all((ROOT / rel.rstrip("/")).exists() for rel in INSTRUCTOR_ONLY), INSTRUCTOR_ONLY  # the list is real
    assert [rel for rel in INSTRUCTOR_ONLY if (edition / rel.rstrip("/")).exists()] == []
    assert {"exercises/INSTRUCTOR.md", "exercises/solutions/", "tests/planted_faults/catalog.py",
            "tests/planted_faults/bug_lab.py"} <= set(INSTRUCTOR_ONLY)
    cut = {lib: (task, c.file) for c in find_cuts(ROOT) for lib, ex, task in c.functions if ex}
    assert {t for t, _ in cut.values()} == {"2.2a", "2.2b", "2.2c", "2.3b", "2.4", "3.2b", "3.3", "4.3a", "4.3b",
                                             "4.4b"}, cut
    for lib, (task, file) in cut.items():  # each a stub that names its task, in the copy's library
        text = (edition / file).read_text()
        stub = next(n for n in ast.parse(text).body if isinstance(n, ast.FunctionDef) and n.name == lib)
        assert f"Task {task}, cut from the student edition" in ast.get_docstring(stub), (file, lib)
        assert "learner_function" in ast.unparse(stub) and len(stub.body) <= 6, (file, lib)
    # the check finds an answer planted in a test helper (what 4.4a's oracle once was), renamed and reformatted
    helper = tmp_path / "tests" / "_helper.py"
    helper.parent.mkdir()
    source = (SOLUTIONS / "parallel_tasks.py").read_text()
    helper.write_text(source.replace("def row_parallel_linear(", "def _oracle(").replace("    ", "  "))
    found = surviving_answers(answers, tmp_path)
    assert any("row_parallel_linear" in f for f in found) and all(f.startswith("tests/_helper.py") for f in found)


@pytest.mark.timeout(600)
def test_the_edition_runs_the_students_code_where_the_library_was_cut(edition, tmp_path):
    """Untouched: the library raises the task's stub error.  Answers pasted (solutions/X.py -> exercises/X.py):
    the graded tests of the cut tasks and the library's own tests of the cut functions pass in the copy."""
    answered = tmp_path / "answered"
    shutil.copytree(edition, answered, ignore=shutil.ignore_patterns(".git", "__pycache__"))
    pasted = 0
    for src in SOLUTIONS.rglob("*.py"):
        rel = src.relative_to(SOLUTIONS)
        if rel.name != "__init__.py" and (answered / "exercises" / rel).exists():
            shutil.copy2(src, answered / "exercises" / rel)
            pasted += 1
    assert pasted >= 11, pasted
    proc = _run(answered, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--impl=student", *IN_THE_COPY)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and " failed" not in out.splitlines()[-1], out[-3000:]
    # an untouched stub (2.3b's, as handed out) and the library's own function handed in as 4.3a's answer:
    # the library raises the task's error where it runs them, not a recursion
    shutil.copy2(edition / "exercises" / "memory_tasks.py", answered / "exercises" / "memory_tasks.py")
    (answered / "exercises" / "checkpoint_tasks.py").write_text(
        "from minifsdp.checkpoint.pieces import load_shard, save_pieces  # noqa: F401\n")
    probe = ("import torch\n"
             "from minifsdp.checkpoint.pieces import save_pieces\n"
             "from minifsdp.memory.zero_formulas import fsdp_model_state_bytes\n"
             "for call in (lambda: fsdp_model_state_bytes([10], 4),\n"
             "             lambda: save_pieces(torch.ones(2), [('w', 2)], 1, 0)):\n"
             "    try:\n        call()\n    except NotImplementedError as e:\n        print('raised:', e)\n")
    said = _run(answered, "-c", probe).stdout
    assert "raised: Task 2.3b: fsdp_model_state_bytes_per_rank -- see exercises/README_memory.md" in said, said
    assert "raised: Task 4.3a: save_pieces" in said and "the library's" in said, said


def test_every_function_the_student_edition_cuts_is_its_tasks_forbidden_answer():
    """A one-line import of the library's function is no answer: the tasks of every cut (the library functions
    the student edition replaces by the learner's) forbid importing it, in the class's grading too, where the
    library is whole."""
    cut = [(f"{c.file.removesuffix('.py').replace('/', '.')}:{lib}", task) for c in find_cuts(ROOT)
           for lib, _, task in c.functions if task]
    assert len(cut) >= 10, cut
    assert [(spec, task) for spec, task in cut if spec not in ANSWERED_BY.get(task, ())] == []


def test_the_syllabus_follows_the_guide(edition):
    guide, rows = (ROOT / GUIDE).read_text(), read_points(ROOT)
    text = (edition / "SYLLABUS.md").read_text()
    assert text == syllabus(guide, rows)
    assert re.findall(r"^## Week (\d+):", text, re.M) == [str(w) for w in range(1, 7)]
    for r in rows:  # every graded task, its points from points.csv and a due week
        assert re.search(rf"^\| `{re.escape(r.task)}` \| [^|]+ \| {r.points} \| [\d.]+ \| end of week [1-6] \|$",
                         text, re.M), r.task
    total = sum(r.points for r in rows)
    assert f"**{total} points in all:**" in text and f"| A | 90% | {-(-90 * total // 100)} |" in text
    for section in ("### How to hand in", "### How points become a grade", "### Working together"):
        assert section in text
    assert "Answer:" not in text and "Common mistakes" not in text  # the guide's answers stay in the guide
    # one table to edit: a due week changed in the guide moves in the syllabus
    due = {t: d for w in schedule(guide, rows) for t, d in w["tasks"]}
    assert due["project-zero1"] == 3 and due["bug"] == 6 and due["2.2a"] == 2
    moved = guide.replace("project-zero1 starts (due week 3)", "project-zero1 starts (due week 4)")
    assert "| end of week 4 |" in syllabus(moved, rows).split("`project-zero1`")[1].splitlines()[0]


def test_the_ring_task_asks_for_the_schedule_not_the_transcription():
    """2.2a-b: the student derives the chunk indices from the picture; the hints are folded away."""
    for rel in ("exercises/README_ring.md", "exercises/ring_collectives.py"):
        text = (ROOT / rel).read_text()
        assert not re.search(r"\(r\s*-\s*s\s*-\s*[12]\)\s*%\s*N|\(r\s*-\s*s\)\s*%\s*N", text), rel
    readme = (ROOT / "exercises" / "README_ring.md").read_text()
    assert "<details>" in readme.split("## Hints")[1] and "</details>" in readme
    assert "r0 -a2-> r1" in readme  # the picture they read it from
    parallel = (ROOT / "exercises" / "README_parallel.md").read_text().split("## Task 4.4b")[1]
    assert "p - s - 1" not in parallel and "<details>" in parallel


def test_a_cut_that_cannot_be_made_stops_the_copy(tmp_path):
    """What course student-copy refuses to cut, each with what to fix: a public function no exercise has, a
    region without its end, a missing argument without a default.  And what a good one writes."""
    (tmp_path / "exercises").mkdir()
    (tmp_path / "exercises" / "tasks.py").write_text(
        'def f(x, group=None):\n    raise NotImplementedError("Task 9.9a: f -- see README")\n')
    start = "# >>> student edition: cut; exercises/tasks.py runs here (task 9.9a)\n"
    good = (f"import torch\n\n\n{start}def _helper(x):\n    return x\n\n\ndef f(x, op='sum', group=None):\n"
            "    return _helper(x)\n# <<< student edition\n")
    text, cuts = cut_source(tmp_path, "minifsdp/m.py", good)
    assert [c.functions for c in cuts] == [(("_helper", None, None), ("f", "f", "9.9a"))]
    assert "_helper" not in text and "learner_function(\"9.9a\", \"exercises.tasks\", \"f\"," in text
    assert "yours takes no op=" in text and text.index("from minifsdp.learner") > text.index("import torch")
    for bad, says in ((good.replace("def f(", "def g("), "has no g to run instead"),
                      (good.replace("# <<< student edition\n", ""), "without its"),
                      (good.replace("def f(x, op='sum',", "def f(x, op,"), "needs op")):
        with pytest.raises(CourseError, match=says):
            cut_source(tmp_path, "minifsdp/m.py", bad)
