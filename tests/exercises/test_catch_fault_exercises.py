"""Grades task 5.3: the learner's test (``exercises/fsdp2_catch_fault.py``) must pass on minifsdp as it is and fail
with a fault planted in ``fully_shard`` that every FSDP2 test the learner is given misses.

The fault is ``reshard_keeps_full_parameters`` (``tests/planted_faults/task_faults.py``): a group's
reshard puts the sharded parameters back but never frees the full ones.  The test under grading runs twice, at
the same time:

* the code as it is: called here, in this process (its ranks come from this process's fork server);
* the fault planted: in a fresh interpreter with ``tests/planted_faults`` on ``PYTHONPATH`` and
  ``MINIFSDP_PLANT_FAULT`` set, whose ``sitecustomize`` plants it in that interpreter and in every rank it starts
  (the mechanism tests/test_planted_faults.py uses); each process reports that it planted it, so a run where the
  fault never arrived cannot pass for a catch.

``--impl=reference`` grades the instructor's test (not in the student edition), which proves the
fault catchable; ``--impl=student`` grades the learner's.  An untouched stub fails here with its
``NotImplementedError``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.exercises import impl_module
from tests.planted_faults.plant import FAULT_ENV, REPORT_ENV, prepare
from tests.planted_faults.task_faults import TASK_5_3_FAULT

ROOT = Path(__file__).resolve().parents[2]
SITE = ROOT / "tests" / "planted_faults"
FAULT = TASK_5_3_FAULT
MODULE, TEST = "fsdp2_catch_fault", "test_catches_the_planted_fault"
TIMEOUT_S = 240
# run in the planted interpreter: the outcome on the last line, whatever the test raises
CHILD = f"""
import sys, traceback
from tests.exercises import impl_module
try:
    getattr(impl_module({MODULE!r}, sys.argv[1]), {TEST!r})()
except BaseException as e:
    traceback.print_exc()
    print("OUTCOME failed", type(e).__name__, str(e).splitlines()[0] if str(e) else "", flush=True)
else:
    print("OUTCOME passed", flush=True)
"""


def _start_planted(impl: str, report: Path) -> subprocess.Popen:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(SITE), str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH")
                                                                  else []))
    env[FAULT_ENV], env[REPORT_ENV] = FAULT.name, str(report)
    return subprocess.Popen([sys.executable, "-c", CHILD, impl], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def test_task5_3_the_test_catches_the_planted_fault(impl, tmp_path):
    prepare(FAULT)  # the fault still applies to the code as it is (else its entry is out of date, and says so)
    test = getattr(impl_module(MODULE, impl), TEST)
    report = tmp_path / "planted.txt"
    planted = _start_planted(impl, report)
    try:
        test()  # the code as it is: must pass (an untouched stub raises its NotImplementedError here)
    except BaseException:
        planted.kill()
        planted.communicate()
        raise
    out, _ = planted.communicate(timeout=TIMEOUT_S)
    lines = report.read_text().splitlines() if report.exists() else []
    assert lines and not [ln for ln in lines if " error " in ln], (
        f"the fault was not planted in the graded run: {lines}\n{out[-3000:]}")
    outcome = [ln for ln in out.splitlines() if ln.startswith("OUTCOME ")]
    assert outcome, f"the planted run ended without an outcome (rc {planted.returncode}):\n{out[-3000:]}"
    assert outcome[-1].startswith("OUTCOME failed"), (
        f"task 5.3: {TEST} passed with the fault planted ({FAULT.plants}): it does not catch it")
