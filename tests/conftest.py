"""Shared pytest options.

``--impl=reference`` (default) grades the exercise tests against minifsdp's own
solutions; ``--impl=student`` grades the stubs in ``exercises/``.
"""

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # so `import exercises` works from a checkout


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

