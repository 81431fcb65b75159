"""Grades task 5.3: the learner's test (``exercises/fsdp2_catch_fault.py``) must pass on minifsdp as it is and fail
with a fault planted in ``fully_shard`` that every FSDP2 test the learner is given misses.

The fault is ``reshard_keeps_full_parameters`` (``tests/planted_faults/task_faults.py``): a group's reshard puts the
sharded parameters back but never frees the full ones.  The test under grading runs twice, at the same time, each
in a fresh interpreter of its own (never in this one: the learner's code decides nothing here):

* the code as it is;
* the fault planted: with ``tests/planted_faults`` on ``PYTHONPATH`` and ``MINIFSDP_PLANT_FAULT`` set, whose
  ``sitecustomize`` plants it in that interpreter and in every rank it starts (the mechanism
  tests/test_planted_faults.py uses); each process reports that it planted it, so a run where the fault never
  arrived cannot pass for a catch.

Each run says how the learner's test ended on a line that carries a number this test drew and handed over on the
run's standard input, read before the learner's module is imported: a line the learner's code prints cannot pass
for it.  Task 5.3's rule (``minifsdp/classroom/course_rules.py``: no environment, no files, no planting code) keeps a
test that asks how it is run, rather than what FSDP2 does, from passing.  ``--impl=reference`` grades the
instructor's test (not in the student edition), which proves the fault catchable.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from pathlib import Path

from minifsdp.classroom.course_remote import failure_in_text
from tests.planted_faults.plant import FAULT_ENV, REPORT_ENV, prepare
from tests.planted_faults.task_faults import TASK_5_3_FAULT

ROOT = Path(__file__).resolve().parents[2]
SITE = ROOT / "tests" / "planted_faults"
FAULT = TASK_5_3_FAULT
MODULE, TEST = "fsdp2_catch_fault", "test_catches_the_planted_fault"
TIMEOUT_S = 300
# the learner's test in a fresh interpreter: the outcome on a line only this code can write (the number is a local)
CHILD = f"""
import sys, traceback
def main():
    nonce = sys.stdin.readline().strip()
    from minifsdp.classroom.course_rules import enforce_here
    from tests.exercises import impl_module
    enforce_here(("5.3",))
    try:
        getattr(impl_module({MODULE!r}, sys.argv[1]), {TEST!r})()
    except BaseException as e:
        traceback.print_exc()
        print("OUTCOME", nonce, "failed", type(e).__name__, str(e).splitlines()[0] if str(e) else "", flush=True)
    else:
        print("OUTCOME", nonce, "passed", flush=True)
main()
"""


def _start(impl: str, nonce: str, report: Path | None) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k not in (FAULT_ENV, REPORT_ENV)}
    path = [str(SITE), str(ROOT)] if report is not None else [str(ROOT)]
    env["PYTHONPATH"] = os.pathsep.join(path + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    if report is not None:
        env[FAULT_ENV], env[REPORT_ENV] = FAULT.name, str(report)
    proc = subprocess.Popen([sys.executable, "-c", CHILD, impl], cwd=ROOT, env=env, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    proc.stdin.write(nonce + "\n")
    proc.stdin.close()
    proc.stdin = None  # written: communicate() has nothing more to send
    return proc


def _outcome(proc: subprocess.Popen, nonce: str) -> tuple[str, str]:
    """("passed" | "failed" | "no outcome", the run's output)."""
    try:
        out, _ = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        out = proc.communicate()[0] + f"\n(stopped after {TIMEOUT_S} s)"
    lines = [ln.split(" ", 2) for ln in out.splitlines() if ln.startswith(f"OUTCOME {nonce} ")]
    return (lines[-1][2].split()[0] if lines else "no outcome"), out


def test_task5_3_the_test_catches_the_planted_fault(impl, tmp_path):
    prepare(FAULT)  # the fault still applies to the code as it is (else its entry is out of date, and says so)
    report = tmp_path / "planted.txt"
    nonces = secrets.token_hex(16), secrets.token_hex(16)
    runs = _start(impl, nonces[0], None), _start(impl, nonces[1], report)
    (clean, clean_out), (planted, planted_out) = (_outcome(p, n) for p, n in zip(runs, nonces, strict=True))
    assert clean == "passed", (f"task 5.3: {TEST} must pass on minifsdp as it is: "
                               f"{failure_in_text(clean_out) if clean_out.strip() else 'no output'}")
    lines = report.read_text().splitlines() if report.exists() else []
    assert lines and not [ln for ln in lines if " error " in ln], (
        f"the fault was not planted in the graded run: {lines}\n{planted_out[-3000:]}")
    assert planted != "no outcome", f"the planted run ended without an outcome:\n{planted_out[-3000:]}"
    assert planted == "failed", f"task 5.3: {TEST} passed with the fault planted ({FAULT.plants}): it does not catch it"
