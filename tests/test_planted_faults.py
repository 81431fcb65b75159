"""Every planted fault is caught by its named test, and that test passes on the code as it is.

The faults (``tests/planted_faults/catalog.py``) are realistic one-line bugs in the library: the gradient
divide factors, padding, the last rank's shard range, resharding after forward, the prefetch direction,
``no_sync``'s scope, the reduce dtype, the grad scaler's cross-rank inf, a local clip norm, checkpoint
piece keys, fully_shard's copy-out offset, resume's RNG, and three regimes (NO_SHARD + ``param_dtype``
accumulation, fp16 at 4 ranks, the divide order at 3 ranks).  Each names the fast test that must catch it.

How a fault reaches a multi-rank test: the named test runs in a pytest subprocess with
``tests/planted_faults`` on ``PYTHONPATH`` and ``MINIFSDP_PLANT_FAULT`` set; that folder's
``sitecustomize.py`` plants the fault in every Python process that starts (the pytest process, the
fork server the ranks are forked from, a spawned rank), in memory: no file changes.  Each process
reports that it planted it; the subprocess reports each test's outcome and failure message.

Baseline (the named test passes unplanted): ``tests/conftest.py`` records every outcome of this session
and runs this module last, so under the whole suite each named test has already run, unplanted; only
those not run yet (this module alone, or a selection) run once more, together, in one subprocess.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.planted_faults.catalog import FAULTS
from tests.planted_faults.outcomes import OUTCOMES_ENV, SESSION, outcome_of
from tests.planted_faults.plant import FAULT_ENV, REPORT_ENV, prepare

ROOT = Path(__file__).resolve().parents[1]
SITE = ROOT / "tests" / "planted_faults"  # its sitecustomize.py plants the fault in every process
ACTIVE = [f for f in FAULTS if not f.pending]
RUN_TIMEOUT_S = 300  # one named test under one fault: 10-70 s on 2 busy cores
PARALLEL = 2  # planted runs at a time


def _run_named(tests: list[str], tmp: Path, fault=None, timeout_s: float = RUN_TIMEOUT_S) -> tuple[dict, str, list]:
    """Run node ids ``tests`` in a fresh pytest process (with ``fault`` planted in it and every rank it starts).

    Returns (outcomes by node id, the run's output, the planting report's lines).
    """
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(SITE), str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH")
                                                                  else []))
    env[OUTCOMES_ENV] = str(tmp / "outcomes.json")
    env.pop(FAULT_ENV, None)
    report = tmp / "planted.txt"
    if fault is not None:
        env[FAULT_ENV], env[REPORT_ENV] = fault.name, str(report)
    # only the plugin the named tests use: the others (nbval, playwright, ...) cost seconds to load, every run
    env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    plugins = ["-p", "pytest_timeout", "--timeout", str(int(timeout_s))] if importlib.util.find_spec("pytest_timeout") \
        else []
    # its own --basetemp: a child pytest sharing ours would prune our (and its sibling's) numbered temp folders
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--basetemp", str(tmp / "pytest"),
           *plugins, *tests]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s + 60)
    log = proc.stdout + proc.stderr
    path = tmp / "outcomes.json"
    outcomes = json.loads(path.read_text()) if path.exists() else {}
    lines = report.read_text().splitlines() if report.exists() else []
    return outcomes, log, lines


def _selected(session) -> list:
    """The active faults whose check this session runs (all of them in CI; one with ``-k``)."""
    names = {item.callspec.params["fault"].name for item in session.items
             if getattr(item, "originalname", None) == "test_named_test_fails_under_the_planted_fault"}
    return [f for f in ACTIVE if f.name in names]


@pytest.fixture(scope="module")
def planted(request, tmp_path_factory):
    """The selected faults' runs, all started at once, ``PARALLEL`` at a time (a run spends much of its time
    starting interpreters, so two overlap well on 2 cores).  ``{name: future of (outcomes, log, report, s)}``."""
    def run(fault, tmp):
        start = time.perf_counter()
        out = _run_named([fault.test], tmp, fault)
        return (*out, time.perf_counter() - start)

    faults = _selected(request.session)
    tmp_path_factory.getbasetemp()  # here, once: pytest makes it lazily and not thread-safely
    folders = [tmp_path_factory.mktemp(f.name) for f in faults]  # in this thread too, before any run starts
    with ThreadPoolExecutor(max_workers=PARALLEL) as pool:
        yield {f.name: pool.submit(run, f, tmp) for f, tmp in zip(faults, folders, strict=True)}


@pytest.fixture(scope="module")
def baseline(request, tmp_path_factory) -> dict[str, dict]:
    """Each named test's outcome on the code as it is: from this session, else from one run of all of them."""
    named = sorted({f.test for f in _selected(request.session)})
    seen = {t: outcome_of(SESSION, t) for t in named}
    missing = [t for t, o in seen.items() if o is None]
    if missing:
        start = time.perf_counter()
        outcomes, log, _ = _run_named(missing, tmp_path_factory.mktemp("baseline"), timeout_s=900)
        print(f"\nbaseline: {len(missing)} named tests not run in this session ran unplanted in "
              f"{time.perf_counter() - start:.0f} s")
        for t in missing:
            seen[t] = outcome_of(outcomes, t) or {"outcome": "not run", "message": log[-3000:]}
    return seen


def test_every_fault_applies_to_the_code_as_it_is():
    """One process, nothing installed: each entry's ``old`` text occurs once in its target, and the edited
    function compiles; names are unique, each named test's file exists.  (A library change that moves a line
    shows here first, with the entry to update.)"""
    assert len({f.name for f in FAULTS}) == len(FAULTS)
    for fault in ACTIVE:
        prepare(fault)
        assert (ROOT / fault.test.split("::")[0]).exists(), (fault.name, fault.test)
        assert fault.old != fault.new and fault.why and fault.plants


@pytest.mark.parametrize("fault", FAULTS, ids=lambda f: f.name)
def test_named_test_fails_under_the_planted_fault(fault, planted, baseline):
    if fault.pending:
        pytest.skip(f"pending: {fault.pending}")
    before = baseline[fault.test]
    assert before["outcome"] == "passed", f"{fault.test} must pass without the fault first: {before}"

    outcomes, log, report, seconds = planted[fault.name].result()
    errors = [line for line in report if " error " in line]
    assert report and not errors, f"{fault.name} was not planted: {errors or 'no process reported'}\n{log[-3000:]}"
    after = outcome_of(outcomes, fault.test)
    assert after is not None, f"{fault.test} did not run under {fault.name}:\n{log[-3000:]}"
    assert after["outcome"] == "failed", (
        f"{fault.test} must FAIL under {fault.name} ({fault.plants}); it {after['outcome']}: "
        f"{after['message'][:1500]}")
    print(f"\n{fault.name} ({seconds:.0f} s, planted in {len(report)} process{'es' * (len(report) > 1)}): {fault.test} "
          f"failed with\n"
          f"    {after['message'][:600]}")
