"""Shared pytest options and hooks.

``--impl=reference`` (default) grades the exercise tests against minifsdp's own
solutions; ``--impl=student`` grades the stubs in ``exercises/``.

Every test's outcome is recorded (``tests/planted_faults/outcomes.py``), and the planted-fault
checks run last: a named test that already passed in this session is their unplanted baseline.
"""

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # so `import exercises` works from a checkout

from tests.planted_faults import outcomes  # noqa: E402 - needs ROOT on sys.path

PLANTED_FAULTS = "tests/test_planted_faults.py"


def pytest_addoption(parser):
    parser.addoption(
        "--impl",
        action="store",
        default="reference",
        choices=("reference", "student"),
        help="which implementation the exercise tests grade: minifsdp's reference or the stubs in exercises/",
    )


@pytest.fixture
def impl(request):
    return request.config.getoption("--impl")



def pytest_collection_modifyitems(items):
    """The planted-fault checks last (a stable sort: every other test keeps its place)."""
    items.sort(key=lambda item: item.nodeid.startswith(PLANTED_FAULTS))


def pytest_runtest_logreport(report):
    outcomes.record(report)


def pytest_sessionfinish(session, exitstatus):
    outcomes.write_if_asked()
