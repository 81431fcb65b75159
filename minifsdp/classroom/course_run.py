"""Running the graded tests of one copy: a pytest subprocess whose outcomes this process can trust.

What ``course grade`` runs for a copy (the repository, the student edition, or one student's copy laid over
this repository by ``course_class.py``):

1. each task's file is read first (``course_rules.file_verdict``): a task whose stub is still there, or whose
   file breaks its rules, is decided without running anything (an untouched copy costs no test at all);
2. the other tasks' tests run in one pytest subprocess (only the test files that hold them), with the grading
   seed; the subprocess is a session of its own, and what it leaves running is ended with it;
3. its outcomes count only if they carry the signature of a key this process handed that pytest through a
   pipe no other process holds (``tests/planted_faults/outcomes.py``): a file written by the learner's code,
   which runs in processes that pytest starts, is refused.

Then :func:`minifsdp.classroom.points.score` turns outcomes into points.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
import secrets
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from minifsdp.classroom.course_rules import file_verdict
from minifsdp.classroom.points import (
    KEY_FD_ENV,
    OUTCOMES_ENV,
    PROJECTS,
    CourseError,
    check_seed,
    graded_rows,
    read_points,
    score,
    task_of,
)

__all__ = ["run_tests", "grade"]


def _test_files(root: Path, tasks: list[str]) -> list[str]:
    """The files under tests/exercises/ that hold a test of ``tasks`` (read, not collected: pytest imports fewer)."""
    known, files = [r.task for r in read_points(root)], []
    for path in sorted((root / "tests" / "exercises").rglob("test_*.py")):
        rel = path.relative_to(root).as_posix()
        names = re.findall(r"^def (test_\w+)", path.read_text(errors="replace"), re.M)
        if any(task_of(f"{rel}::{n}", known) in tasks for n in names):
            files.append(rel)
    return files or ["tests/exercises"]


def _decided(task: str) -> str:
    """A node id that stands for ``task``'s tests when its file decided it (:func:`task_of` maps it back)."""
    if task.startswith("project-"):
        return f"{PROJECTS}{task[8:].replace('-', '_')}/the_file::read"
    return f"tests/exercises/the_file::test_task{task.replace('.', '_')}_read"


def _kill_group(proc: subprocess.Popen) -> None:
    """End what the tests left running (the learner's processes included): the run was a session of its own."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


def run_tests(root: Path, impl: str, tasks: list[str], timeout_s: float = 3600, seed: int = 0) -> tuple[dict, str]:
    """Run the tests of ``tasks`` in ``root`` against ``impl`` in a pytest subprocess: (outcomes by node id, log).
    The outcomes count only if signed with the key handed to that pytest (``tests/planted_faults/outcomes.py``)."""
    with tempfile.TemporaryDirectory(prefix="minifsdp-grade-") as tmp:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(root)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
        env[OUTCOMES_ENV] = out = str(Path(tmp) / "outcomes.json")
        env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"  # nbval, playwright, ...: seconds each run, unused here
        env.pop("MINIFSDP_PLANT_FAULT", None)
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--basetemp", str(Path(tmp) / "t"),
               *_test_files(root, tasks), f"--impl={impl}", f"--course-task={','.join(tasks)}", f"--course-seed={seed}"]
        try:
            import pytest_timeout  # noqa: F401

            cmd[3:3] = ["-p", "pytest_timeout", "--timeout", "600"]  # a hung ring fails its test, not the grader
        except ImportError:
            pass
        key = secrets.token_bytes(32)
        read_end, write_end = os.pipe()
        os.write(write_end, key)
        os.close(write_end)
        env[KEY_FD_ENV] = str(read_end)
        proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                pass_fds=(read_end,), start_new_session=True)
        os.close(read_end)
        try:
            log = proc.communicate(timeout=timeout_s)[0]
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            log = proc.communicate()[0] + f"\nthe tests ran past {timeout_s:.0f} s and were stopped"
        _kill_group(proc)
        outcomes = {}
        if Path(out).exists():
            data = Path(out).read_bytes()
            sig = Path(out + ".hmac").read_text().strip() if Path(out + ".hmac").exists() else ""
            if not hmac.compare_digest(sig, hmac.new(key, data, hashlib.sha256).hexdigest()):
                raise CourseError("the tests' outcomes are not the ones the grader's pytest signed: something in "
                                  "the graded copy wrote them (no points are given for this copy)")
            outcomes = json.loads(data)
    return outcomes, log


def grade(root: Path, impl: str, only: list[str] | None = None, seed: int = 0) -> tuple[list[dict], list[str]]:
    """The tasks and projects of ``root`` (not the bug lab) graded against ``impl`` on the grading ``seed``:
    (:func:`score`'s rows, strays)."""
    rows = [r for r in graded_rows(root, only) if r.task != "bug"]
    if impl == "reference" and not (root / "exercises" / "solutions").is_dir():
        raise CourseError("--impl reference grades the instructor's answers, which the student edition leaves out: "
                          "grade your own code (--impl student, the default)")
    if not rows:
        return [], []
    decided = {r.task: file_verdict(root, r.task, impl) for r in rows}  # a stub or a broken rule: nothing to run
    to_run = [r.task for r in rows if not decided[r.task]]
    outcomes, log = run_tests(root, impl, to_run, seed=check_seed(seed)) if to_run else ({}, "")
    outcomes.update({_decided(t): {"outcome": "failed", "message": line} for t, line in decided.items() if line})
    return score(outcomes, rows, log)
