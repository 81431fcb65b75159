"""Shared pytest options and hooks.

``--impl=student`` grades the stubs in ``exercises/`` (the learner's code); ``--impl=reference`` the
instructor's answers in ``exercises/solutions/``, the default where that folder is.  The student edition
has none: there the task tests are skipped unless ``--impl=student`` is given, so the README's test
command passes on untouched stubs, and ``python -m minifsdp course grade`` scores them.
``--course-task 2.2a,project-zero1`` keeps only those tasks' tests (the grader's selection);
``--course-seed S`` is the grading seed the tests draw their inputs from (0 unless given).

Every test's outcome is recorded (``tests/planted_faults/outcomes.py``), and the planted-fault
checks run last: a named test that already passed in this session is their unplanted baseline.
"""

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # so `import exercises` works from a checkout

from tests import _tiers  # noqa: E402 - needs ROOT on sys.path
from tests.planted_faults import outcomes  # noqa: E402 - needs ROOT on sys.path

PLANTED_FAULTS = "tests/test_planted_faults.py"


def pytest_addoption(parser):
    parser.addoption(
        "--impl",
        action="store",
        default=None,
        choices=("reference", "student"),
        help="which implementation the exercise tests grade: the instructor's reference (exercises/solutions/, "
             "the default where it exists) or the stubs in exercises/ (student)",
    )
    parser.addoption("--course-task", action="store", default=None,
                     help="only these graded tasks' tests, comma-separated ids of exercises/points.csv")
    parser.addoption("--course-seed", action="store", type=int, default=0,
                     help="the grading seed: the graded tests draw their inputs from it (default 0)")
    parser.addoption("--extended", action="store_true", default=False,
                     help="also run what the README's test command leaves out to keep CI within its budget "
                          "(tests/_tiers.py lists it): every planted fault, every CI fuzz seed, the whole torch "
                          "suite port, notebooks 02-04, the torchrun and browser runs")


def pytest_configure(config):
    config.addinivalue_line("markers", "points(weight): this test's share of its project's points (by weight)")


@pytest.fixture(scope="session")
def impl(request):
    chosen = request.config.getoption("--impl")
    if chosen is not None:
        return chosen
    if (ROOT / "exercises" / "solutions" / "__init__.py").exists():
        return "reference"
    pytest.skip("the student edition: task tests grade your code with `python -m minifsdp course grade` "
                "(or pytest --impl=student)")


def pytest_collection_modifyitems(config, items):
    """Without ``--extended``, the extended tier is deselected (``tests/_tiers.py``); the planted-fault checks
    last (a stable sort: every other test keeps its place)."""
    if not config.getoption("--extended"):
        drop = [item for item in items if _tiers.extended_item(item)]
        if drop:
            config.hook.pytest_deselected(items=drop)
            kept = set(map(id, drop))
            items[:] = [item for item in items if id(item) not in kept]
    items.sort(key=lambda item: item.nodeid.startswith(PLANTED_FAULTS))


def pytest_runtest_logreport(report):
    outcomes.record(report)


def pytest_sessionfinish(session, exitstatus):
    outcomes.write_if_asked()
