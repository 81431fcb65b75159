"""The grading works both ways: untouched stubs fail every task.

(The reference direction needs no extra run: `tests/exercises` is collected by
the normal test command with the default `--impl=reference`, so every task
passing against minifsdp's own solution is part of CI already.)
"""

import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(300)
def test_untouched_stubs_fail_every_task(tmp_path):
    report = tmp_path / "student.xml"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "tests/exercises", "--impl=student", "-q", "-p", "no:cacheprovider",
         f"--junitxml={report}"],
        cwd=ROOT, capture_output=True, text=True,
    )
    cases = ET.parse(report).getroot().iter("testcase")
    outcomes = {}
    for case in cases:
        failed = case.find("failure") is not None or case.find("error") is not None
        outcomes[f"{case.get('classname')}::{case.get('name')}"] = (failed, ET.tostring(case, encoding="unicode"))
    assert outcomes, "no exercise tests were collected:\n" + proc.stdout[-2000:]
    passed = [name for name, (failed, _) in outcomes.items() if not failed]
    assert not passed, f"these tasks pass with the bare stubs, so they grade nothing: {passed}"
    for name, (_, text) in outcomes.items():
        assert "NotImplementedError" in text and "Task" in text, f"{name} failed for another reason than the stub"
