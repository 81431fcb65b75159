"""Each test's outcome in this pytest session, recorded by ``tests/conftest.py``.

``SESSION``: ``{node id: {"outcome": "passed" | "failed" | "error" | "skipped", "message": ...}}``;
"failed" is a failure in the test itself (its assertion: ``message`` is the line pytest prints after
"E"), "error" one in its setup or teardown (a fixture).  Two readers:

* ``tests/test_planted_faults.py``, in the same session: a named test that already ran here, on the
  code as it is, needs no second run as its unplanted baseline;
* the pytest subprocess that runs a named test under a planted fault (or a student's tests, for
  ``course grade``) writes ``SESSION`` to the file ``MINIFSDP_PLANT_OUTCOMES`` names when it ends, for
  the process that started it to read.

The file's name is read once, when this module is imported (before any test runs), and taken out of the
environment: no process the tests start (a rank, the learner's process) learns where it is.  Where the
starter gives a key (``course grade``: a pipe whose number ``MINIFSDP_COURSE_KEY_FD`` names, read here and
closed), the file is signed: ``<file>.hmac`` holds HMAC-SHA256 of its bytes, which the starter checks, so a
file written by anyone else does not pass for the outcomes.  A test's ``points`` (``@pytest.mark.points``,
kept in its report's ``user_properties``) is recorded with its outcome, and ``points_total``, the weights of
all its task's tests (so a test that never ran still holds its share).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os

__all__ = ["SESSION", "OUTCOMES_ENV", "KEY_FD_ENV", "record", "write_if_asked", "outcome_of", "signature"]

OUTCOMES_ENV = "MINIFSDP_PLANT_OUTCOMES"
KEY_FD_ENV = "MINIFSDP_COURSE_KEY_FD"
SESSION: dict[str, dict] = {}
_PATH = os.environ.pop(OUTCOMES_ENV, None)


def _read_key() -> bytes | None:
    fd = os.environ.pop(KEY_FD_ENV, None)
    if not fd:
        return None
    try:
        key = os.read(int(fd), 4096)
        os.close(int(fd))
    except (OSError, ValueError):
        return None
    return key or None


_KEY = _read_key()


def signature(key: bytes, data: bytes) -> str:
    return hmac.new(key, data, hashlib.sha256).hexdigest()


def record(report) -> None:
    """Fold one phase's report (setup, call, teardown) into ``SESSION``; a failure is never overwritten."""
    if SESSION.get(report.nodeid, {}).get("outcome") in ("failed", "error"):
        return
    extra = {k: v for k, v in getattr(report, "user_properties", ()) if k in ("points", "points_total")}
    if report.failed:
        crash = getattr(report.longrepr, "reprcrash", None)
        message = crash.message if crash is not None else str(report.longrepr)[-2000:]
        graded = report.when == "call" or getattr(report, "graded_before_setup", False)
        SESSION[report.nodeid] = {"outcome": "failed" if graded else "error", "message": message, **extra}
    elif report.skipped:
        reason = report.longrepr[-1] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        SESSION[report.nodeid] = {"outcome": "skipped", "message": reason, **extra}
    elif report.when == "call":
        SESSION[report.nodeid] = {"outcome": "passed", "message": "", **extra}


def write_if_asked() -> None:
    if _PATH:
        data = json.dumps(SESSION, indent=1).encode()
        with open(_PATH, "wb") as f:
            f.write(data)
        if _KEY is not None:
            with open(_PATH + ".hmac", "w") as f:
                f.write(signature(_KEY, data))


def outcome_of(outcomes: dict[str, dict], test: str) -> dict | None:
    """The outcome of node id ``test`` (every parametrized case of it, when it names a function): failed if
    any case failed, else error if any errored, passed if every case passed; None if it never ran."""
    cases = [v for k, v in outcomes.items() if k == test or k.startswith(test + "[")]
    if not cases:
        return None
    for kind in ("failed", "error", "skipped"):
        bad = [c for c in cases if c["outcome"] == kind]
        if bad:
            return bad[0]
    return cases[0]
