"""``python -m minifsdp torch-suite``: run the ports of torch's FSDP1 and FSDP2 tests, a table per suite.

The ports live in the checkout's ``tests/torch_suite/`` (FSDP1: one module per torch ``test_fsdp_*.py``) and
``tests/torch_suite/fsdp2/`` (FSDP2: one module per torch ``test_fully_shard_*.py``); see their ``__init__``.
This command runs them with pytest in a subprocess (the whole FSDP2 port, not only its CI slice), reads
pytest's JUnit XML, and counts per group (module ``test_<group>.py``), FSDP1's table first:

    group               passed / total   torch fails on CPU
    core                    80 / 80       0
    ...
    FSDP2 (fully_shard)
    training               149 / 149      0
    ...

``total`` counts every case torch passes on CPU: an ``xfail`` (a known gap of ours) counts as
failed; a case torch itself fails on CPU is skipped, listed apart and not counted.  The tables and
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
SUITES = ("fsdp1", "fsdp2")
FSDP2_HEADER = "FSDP2 (fully_shard)"


def parse_junit(xml_text: str) -> list[dict]:
    """One record per test case: ``{"suite", "group", "case", "outcome", "message"}``; outcome is one of
    passed, failed, xfailed (a known gap: counted as failed), skipped (torch fails on CPU)."""
    out = []
    for tc in ET.fromstring(xml_text).iter("testcase"):
        classname = tc.get("classname", "")
        suite = "fsdp2" if ".fsdp2." in f".{classname}." else "fsdp1"
        module = classname.rsplit(".", 1)[-1]
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
        out.append({"suite": suite, "group": group, "case": case, "outcome": outcome, "message": first[:300]})
    return out


def _summarize_one(records: list[dict]) -> dict:
    groups: dict = {}
    not_counted = []
    for r in records:
        g = groups.setdefault(r["group"], {"passed": 0, "total": 0, "torch_fails": 0, "failures": []})
        if r["outcome"] == "skipped":
            g["torch_fails"] += 1
            not_counted.append((r["group"], r["case"], r["message"].split(" on CPU: ", 1)[-1]))
            continue
        g["total"] += 1
        if r["outcome"] == "passed":
            g["passed"] += 1
        else:
            g["failures"].append((r["case"], ("[xfail] " if r["outcome"] == "xfailed" else "") + r["message"]))
    overall = {k: sum(g[k] for g in groups.values()) for k in ("passed", "total", "torch_fails")}
    return {"groups": groups, "overall": overall, "not_counted": not_counted}


def summarize(records: list[dict]) -> dict:
    """FSDP1's ``{"groups": {group: {"passed", "total", "torch_fails", "failures": [(case, first line)]}},
    "overall", "not_counted": [(group, case, torch's error)]}``, and the same for FSDP2 under ``"fsdp2"`` when its
    port ran."""
    out = _summarize_one([r for r in records if r.get("suite", "fsdp1") == "fsdp1"])
    fsdp2 = [r for r in records if r.get("suite") == "fsdp2"]
    if fsdp2:
        out["fsdp2"] = _summarize_one(fsdp2)
    return out


def _section(summary: dict, who: str) -> list[str]:
    """The table, then each failing case (``FAILED group case: first line``), then what torch itself fails on
    this CPU (two spaces in front: the lines the committed table's check counts)."""
    lines = [f"{'group':<22}{'passed / total':>16}   torch fails on CPU (not counted)"]
    for name, g in sorted(summary["groups"].items()):
        lines.append(f"{name:<22}{g['passed']:>7} / {g['total']:<6}   {g['torch_fails']}")
    o = summary["overall"]
    lines.append(f"{'overall':<22}{o['passed']:>7} / {o['total']:<6}   {o['torch_fails']}")
    for name, g in sorted(summary["groups"].items()):
        for case, msg in g["failures"]:
            lines.append(f"FAILED {name} {case}: {msg}")
    if summary.get("not_counted"):
        lines += ["", f"not counted: the cases {who} itself fails on this CPU-only machine "
                      "(first line of torch's error)"]
        lines += [f"  {group} {case}: {msg}" for group, case, msg in summary["not_counted"]]
    return lines


def format_table(summary: dict) -> str:
    """FSDP1's section, then FSDP2's (headed ``FSDP2 (fully_shard)``) when its port ran."""
    lines = _section(summary, "torch FSDP1") if summary["groups"] else []
    if "fsdp2" in summary:
        lines += ["", FSDP2_HEADER] + _section(summary["fsdp2"], "torch's fully_shard")
    return "\n".join(lines)


def run(group: str | None = None, fast: bool = False, json_path: str | None = "out/torch_suite.json",
        extra: list[str] | None = None, suite: str = "all") -> dict:
    """Run ``suite`` (``fsdp1``, ``fsdp2`` or ``all``), or one ``group`` of it, and summarize."""
    if not SUITE.is_dir():
        raise FileNotFoundError(f"{SUITE} is not there: the port ships with a checkout of minifsdp, run from one")
    if suite not in (*SUITES, "all"):
        raise ValueError(f"suite {suite!r}: one of {SUITES} or 'all'")
    base = SUITE / "fsdp2" if suite == "fsdp2" else SUITE
    target = str(base / f"test_{group}.py") if group else str(base)
    extra = list(extra or [])
    if suite == "fsdp1":
        extra += ["--ignore", str(SUITE / "fsdp2")]
    with tempfile.TemporaryDirectory() as tmp:
        xml = os.path.join(tmp, "junit.xml")
        cmd = [sys.executable, "-m", "pytest", target, "-q", "-p", "no:cacheprovider", f"--junitxml={xml}",
               "-o", "junit_family=xunit2", "--tb=no", "--extended"] + (["-m", "fast"] if fast else []) + extra
        # (--extended: the default collection keeps only the FSDP1 port's fast cases, tests/_tiers.py)
        env = dict(os.environ)
        env["MINIFSDP_TORCH_SUITE_FSDP2"] = "fast" if fast else "all"  # the FSDP2 port's whole matrix
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
    summary = run(args.group, args.fast, args.json or None, suite=getattr(args, "suite", "all"))
    print(format_table(summary))
    return 0
