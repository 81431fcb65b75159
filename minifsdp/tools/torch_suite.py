"""``python -m minifsdp torch-suite``: run the port of torch's FSDP1 tests and print a table per group.

The port lives in the checkout's ``tests/torch_suite/`` (one module per torch test file, see its
``__init__``).  This command runs it with pytest in a subprocess, reads pytest's JUnit XML, and counts
per group (module ``test_<group>.py``):

    group               passed / total   torch fails on CPU
    core                    80 / 80       0
    ...

``total`` counts every case torch FSDP1 passes on CPU: an ``xfail`` (a known gap of ours) counts as
failed; a case torch itself fails on CPU is skipped, listed apart and not counted.  The table and
every case's outcome go to ``out/torch_suite.json`` too.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

SUITE = Path(__file__).resolve().parents[2] / "tests" / "torch_suite"


def parse_junit(xml_text: str) -> list[dict]:
    """One record per test case: ``{"group", "case", "outcome", "message"}``; outcome is one of
    passed, failed, xfailed (a known gap: counted as failed), skipped (torch fails on CPU)."""
    out = []
    for tc in ET.fromstring(xml_text).iter("testcase"):
        module = tc.get("classname", "").rsplit(".", 1)[-1]
        group = module.removeprefix("test_")
        name = tc.get("name", "")
        case = name[name.index("[") + 1:-1] if "[" in name else name
        outcome, message = "passed", ""
        for child in tc:
            if child.tag in ("failure", "error"):
                outcome, message = "failed", child.get("message", "") or (child.text or "")
            elif child.tag == "skipped":
                xfail = child.get("type") == "pytest.xfail"
                outcome, message = ("xfailed" if xfail else "skipped"), child.get("message", "")
        first = message.strip().splitlines()[0] if message.strip() else ""
        out.append({"group": group, "case": case, "outcome": outcome, "message": first[:300]})
    return out


def summarize(records: list[dict]) -> dict:
    """``{group: {"passed", "total", "torch_fails", "failures": [(case, first line)]}}`` plus ``"overall"``."""
    groups: dict = {}
    for r in records:
        g = groups.setdefault(r["group"], {"passed": 0, "total": 0, "torch_fails": 0, "failures": []})
        if r["outcome"] == "skipped":
            g["torch_fails"] += 1
            continue
        g["total"] += 1
        if r["outcome"] == "passed":
            g["passed"] += 1
        else:
            g["failures"].append((r["case"], ("[xfail] " if r["outcome"] == "xfailed" else "") + r["message"]))
    overall = {k: sum(g[k] for g in groups.values()) for k in ("passed", "total", "torch_fails")}
    return {"groups": groups, "overall": overall}


def format_table(summary: dict) -> str:
    lines = [f"{'group':<22}{'passed / total':>16}   torch fails on CPU (not counted)"]
    for name, g in sorted(summary["groups"].items()):
        lines.append(f"{name:<22}{g['passed']:>7} / {g['total']:<6}   {g['torch_fails']}")
    o = summary["overall"]
    lines.append(f"{'overall':<22}{o['passed']:>7} / {o['total']:<6}   {o['torch_fails']}")
    for name, g in sorted(summary["groups"].items()):
        for case, msg in g["failures"]:
            lines.append(f"  {name} {case}: {msg}")
    return "\n".join(lines)


def run(group: str | None = None, fast: bool = False, json_path: str | None = "out/torch_suite.json",
        extra: list[str] | None = None) -> dict:
    if not SUITE.is_dir():
        raise FileNotFoundError(f"{SUITE} is not there: the port ships with a checkout of minifsdp, run from one")
    target = str(SUITE / f"test_{group}.py") if group else str(SUITE)
    with tempfile.TemporaryDirectory() as tmp:
        xml = os.path.join(tmp, "junit.xml")
        cmd = [sys.executable, "-m", "pytest", target, "-q", "-p", "no:cacheprovider", f"--junitxml={xml}",
               "-o", "junit_family=xunit2", "--tb=no"] + (["-m", "fast"] if fast else []) + (extra or [])
        env = dict(os.environ)
        proc = subprocess.run(cmd, cwd=SUITE.parents[1], env=env, capture_output=True, text=True)
        if not os.path.exists(xml):
            raise RuntimeError(f"pytest wrote no report (exit {proc.returncode}):\n{proc.stdout[-3000:]}"
                               f"{proc.stderr[-3000:]}")
        records = parse_junit(Path(xml).read_text())
    summary = summarize(records)
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps({**summary, "cases": records}, indent=1))
    return summary


def run_torch_suite(args) -> int:
    summary = run(args.group, args.fast, args.json or None)
    print(format_table(summary))
    return 0
