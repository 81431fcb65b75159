"""How the graded tests run: the learner's code apart, the rules first, only the tasks asked for, one line each.

* ``--course-task 2.2a,project-zero1`` (``tests/conftest.py``) keeps the tests of those tasks
  (``minifsdp.classroom.points.task_of`` maps a test to its task) and deselects the others.
* Before a graded test sets anything up, its task's file is read (``minifsdp/classroom/course_rules.py``): a stub
  of the task still in it reads ``task 2.2a not done yet: exercises/ring_collectives.py ring_reduce_scatter``
  (nothing runs, no spawn waits); a broken rule reads ``rule broken: exercises/x.py:12: ...``.  Both are the
  test's failure, not an error of its setup.
* ``learner``: the learner's module, run in the learner's process (``course_remote.LearnerProcess``, one per
  session); ``course_seed``: the grading seed.  After each graded test, no learner module may have been
  imported in this process: a test that did would let the learner's code decide its outcome.
* A failure whose cause is a stub's ``NotImplementedError`` (raised again here, or quoted from a rank) reads in
  one line too, in the learner's own ``pytest`` and in ``course grade`` alike.
"""

import sys
from pathlib import Path

import pytest

from minifsdp.classroom.course_remote import LearnerProcess, learner_module
from minifsdp.classroom.course_rules import LEARNER_FILES, file_verdict
from minifsdp.classroom.points import not_done, read_points, task_of
from tests.exercises import module_name

ROOT = Path(__file__).resolve().parents[2]
HERE = "tests/exercises/"
_LEARNER_MODULES = {module_name(".".join(Path(f).with_suffix("").parts[1:]), impl)
                    for f in LEARNER_FILES for impl in ("student", "reference")}


def _known() -> list[str]:
    return [r.task for r in read_points(ROOT)]


def pytest_collection_modifyitems(config, items):
    known, weights = _known(), {}  # every weighted test function of each task, before any is deselected
    for item in items:
        marker = item.get_closest_marker("points")
        if marker is not None and item.nodeid.startswith(HERE):
            weights.setdefault(task_of(item.nodeid, known), {})[item.nodeid.split("[", 1)[0]] = marker.args[0]
    for item in items:
        marker = item.get_closest_marker("points")
        if marker is not None and item.nodeid.startswith(HERE):
            item.user_properties += [("points", marker.args[0]),
                                     ("points_total", sum(weights[task_of(item.nodeid, known)].values()))]
    wanted = config.getoption("--course-task")
    if not wanted:
        return
    wanted = {t.strip() for t in wanted.split(",") if t.strip()}
    keep, drop = [], []
    for item in items:
        mine = item.nodeid.startswith(HERE) and task_of(item.nodeid, known) in wanted
        (keep if mine else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


class GradedBeforeSetup(Exception):
    """The task's file decides the test before it runs: not done yet, or a rule broken."""


def _impl_of(config) -> str | None:
    chosen = config.getoption("--impl")
    if chosen is None and (ROOT / "exercises" / "solutions" / "__init__.py").exists():
        return "reference"
    return chosen


_VERDICTS: dict[tuple[str, str], str] = {}


def verdict_from_the_file(task: str, impl: str) -> str:
    """Why ``task`` fails before any test of it runs (``course_rules.file_verdict``; "" if nothing decides it)."""
    if (task, impl) not in _VERDICTS:
        _VERDICTS[(task, impl)] = file_verdict(ROOT, task, impl)
    return _VERDICTS[(task, impl)]


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    if not item.nodeid.startswith(HERE):
        return
    impl, task = _impl_of(item.config), task_of(item.nodeid, _known())
    if impl is None or task is None:
        return  # the student edition without --impl: the `impl` fixture skips
    line = verdict_from_the_file(task, impl)
    if line:
        raise GradedBeforeSetup(line)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    before = set(sys.modules)
    result = yield
    if item.nodeid.startswith(HERE):
        imported = sorted((set(sys.modules) - before) & _LEARNER_MODULES)
        if imported:
            raise AssertionError(f"the grading process imported the learner's {', '.join(imported)}: a graded test "
                                 "runs the learner's code only in its own process (the `learner` fixture, a rank)")
    return result


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if not report.failed or not item.nodeid.startswith(HERE) or call.excinfo is None:
        return
    if call.excinfo.errisinstance(GradedBeforeSetup):
        report.longrepr = str(call.excinfo.value)
        report.graded_before_setup = True
        return
    task = task_of(item.nodeid, _known()) or "?"
    line = not_done(task, ROOT, excinfo=call.excinfo, text=f"{call.excinfo.typename}: {call.excinfo.value}")
    if line is not None:
        report.longrepr = line


@pytest.fixture(scope="session")
def learner_process():
    process = LearnerProcess()
    yield process
    process.close()


@pytest.fixture
def learner(request, impl, learner_process):
    """``learner("launch_tasks")``: the learner's module (or the instructor's, ``--impl=reference``), each of its
    functions run in the learner's process under this test's task's rules."""
    task = task_of(request.node.nodeid, _known())

    def module(name: str):
        return learner_module(learner_process, module_name(name, impl), task or ())

    return module


@pytest.fixture(scope="session")
def course_seed(request) -> int:
    return request.config.getoption("--course-seed")
