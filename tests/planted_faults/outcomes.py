"""Each test's outcome in this pytest session, recorded by ``tests/conftest.py``.

``SESSION``: ``{node id: {"outcome": "passed" | "failed" | "error" | "skipped", "message": ...}}``;
"failed" is a failure in the test itself (its assertion: ``message`` is the line pytest prints after
"E"), "error" one in its setup or teardown (a fixture).  Two readers:

* ``tests/test_planted_faults.py``, in the same session: a named test that already ran here, on the
  code as it is, needs no second run as its unplanted baseline;
* the pytest subprocess that runs a named test under a planted fault writes ``SESSION`` to the file
  ``MINIFSDP_PLANT_OUTCOMES`` names when it ends, for the test that started it to read.
"""

from __future__ import annotations

import json
import os

__all__ = ["SESSION", "OUTCOMES_ENV", "record", "write_if_asked", "outcome_of"]

OUTCOMES_ENV = "MINIFSDP_PLANT_OUTCOMES"
SESSION: dict[str, dict] = {}


def record(report) -> None:
    """Fold one phase's report (setup, call, teardown) into ``SESSION``; a failure is never overwritten."""
    if SESSION.get(report.nodeid, {}).get("outcome") in ("failed", "error"):
        return
    if report.failed:
        crash = getattr(report.longrepr, "reprcrash", None)
        message = crash.message if crash is not None else str(report.longrepr)[-2000:]
        SESSION[report.nodeid] = {"outcome": "failed" if report.when == "call" else "error", "message": message}
    elif report.skipped:
        reason = report.longrepr[-1] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        SESSION[report.nodeid] = {"outcome": "skipped", "message": reason}
    elif report.when == "call":
        SESSION[report.nodeid] = {"outcome": "passed", "message": ""}


def write_if_asked() -> None:
    path = os.environ.get(OUTCOMES_ENV)
    if path:
        with open(path, "w") as f:
            json.dump(SESSION, f, indent=1)


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
