"""How the graded tests report: one line for an untouched stub, and only the tasks asked for.

* ``--course-task 2.2a,project-zero1`` (``tests/conftest.py``) keeps the tests of those tasks
  (``minifsdp.tools.course.task_of`` maps a test to its task) and deselects the others.
* A test that fails because a stub raised ``NotImplementedError`` (here, or on a rank, quoted in the
  assertion) reports one line, ``task 2.2a not done yet: exercises/ring_collectives.py ring_reduce_scatter``,
  instead of a traceback through the test: the learner's own ``pytest`` and ``course grade`` print it alike.
"""

from pathlib import Path

import pytest

from minifsdp.tools.course import not_done, read_points, task_of

ROOT = Path(__file__).resolve().parents[2]
HERE = "tests/exercises/"


def _known() -> list[str]:
    return [r.task for r in read_points(ROOT)]


def pytest_collection_modifyitems(config, items):
    wanted = config.getoption("--course-task")
    if not wanted:
        return
    wanted = {t.strip() for t in wanted.split(",") if t.strip()}
    known = _known()
    keep, drop = [], []
    for item in items:
        mine = item.nodeid.startswith(HERE) and task_of(item.nodeid, known) in wanted
        (keep if mine else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if not report.failed or not item.nodeid.startswith(HERE) or call.excinfo is None:
        return
    task = task_of(item.nodeid, _known()) or "?"
    line = not_done(task, ROOT, excinfo=call.excinfo, text=str(call.excinfo.value))
    if line is not None:
        report.longrepr = line
