"""The port of torch's FSDP1 tests (tests/torch_suite): its CI slice, its runner, and its command's table.

The whole port runs in the default collection (about 2 minutes on 2 cores) and by ``python -m minifsdp
torch-suite``.  Here: one group's cases marked ``fast`` through that very command (its end to end),
the runner on planted faults (a wrong parameter must fail parity with DDP, a crash must be blamed on
the side that crashed and cost one case only), and the table built from a tiny JUnit report.
"""

import json
import re
from pathlib import Path

from minifsdp.commands import torch_suite as T
from tests.torch_suite import _harness as H

JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
<testcase classname="tests.torch_suite.test_core" name="test_case[a:x=1]" time="0.1"/>
<testcase classname="tests.torch_suite.test_core" name="test_case[b:x=2]" time="0.1">
  <failure message="rank 0: AssertionError: loss vs DDP&#10;second line">tb</failure></testcase>
<testcase classname="tests.torch_suite.test_core" name="test_case[c]" time="0.1">
  <skipped type="pytest.xfail" message="a known gap" /></testcase>
<testcase classname="tests.torch_suite.test_grad_acc" name="test_case[d]" time="0.1">
  <skipped type="pytest.skip" message="torch FSDP1 fails on CPU: X" /></testcase>
<testcase classname="tests.torch_suite.test_grad_acc" name="test_case[e]" time="0.1"/>
</testsuite></testsuites>"""


def test_the_command_runs_the_whole_port_not_only_the_default_tier(monkeypatch):
    """The default collection keeps only the FSDP1 port's fast cases: the command asks for every case."""
    import subprocess

    seen = []

    def fake_run(cmd, **kwargs):
        seen.append(cmd)
        xml = next(a.split("=", 1)[1] for a in cmd if a.startswith("--junitxml="))
        Path(xml).write_text(JUNIT)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(T.subprocess, "run", fake_run)
    T.run(json_path=None, suite="fsdp1")
    T.run(json_path=None, suite="fsdp1", fast=True)
    assert len(seen) == 2
    assert "--extended" in seen[0] and " -m fast" not in " ".join(seen[0])
    assert " -m fast" in " ".join(seen[1])


def test_table_from_a_tiny_report():
    records = T.parse_junit(JUNIT)
    assert [(r["group"], r["case"], r["outcome"]) for r in records] == [
        ("core", "a:x=1", "passed"), ("core", "b:x=2", "failed"), ("core", "c", "xfailed"),
        ("grad_acc", "d", "skipped"), ("grad_acc", "e", "passed")]
    s = T.summarize(records)
    assert s["groups"]["core"] == {"passed": 1, "total": 3, "torch_fails": 0, "failures": [
        ("b:x=2", "rank 0: AssertionError: loss vs DDP"), ("c", "[xfail] a known gap")]}
    assert s["overall"] == {"passed": 2, "total": 4, "torch_fails": 1}
    table = T.format_table(s).splitlines()
    assert table[1].split() == ["core", "1", "/", "3", "0"]
    assert table[3].split() == ["overall", "2", "/", "4", "1"]
    assert "core b:x=2: rank 0: AssertionError: loss vs DDP" in table[4]


def test_runner_catches_planted_faults():
    """A case failing on one rank only, while the other waits for it in a collective, ends its batch as soon as
    the failed rank has waited ``LEFT_WAITING_S`` for the other (not at the batch's time limit): its result names
    the failure, and its traceback holds the failed rank's and where the other waited; the cases after it run."""
    ids = ["wrong_param", "crash_ours", "fails_on_one_rank_only", "forgot_wait", "fine"]
    res = H._run("tests.torch_suite._selftest", ids, 2)
    assert len(res) == 5
    assert res["forgot_wait"]["torch"] is None and "vs DDP" in res["forgot_wait"]["ours"]
    assert res["wrong_param"]["torch"] is None and "vs DDP" in res["wrong_param"]["ours"]
    assert res["crash_ours"]["torch"] is None and "died" in res["crash_ours"]["ours"]
    one = res["fails_on_one_rank_only"]
    assert one["torch"] is None and "rank 1 failed (AssertionError: planted" in one["ours"], one
    assert "left waiting" in one["ours"] and "dist.all_reduce(torch.ones(1))" in one["ours_tb"], one
    assert "--- rank 1: AssertionError" in one["ours_tb"], one
    assert res["fine"]["torch"] is None and res["fine"]["ours"] is None


def test_fast_slice_through_the_command(tmp_path):
    out = tmp_path / "ts.json"
    s = T.run(group="model_usage", fast=True, json_path=str(out))
    assert out.exists()
    assert set(s["groups"]) == {"model_usage"}
    cases = json.loads(out.read_text())["cases"]
    failed = [(c["group"], c["case"], c["message"]) for c in cases if c["outcome"] == "failed"]
    assert not failed, failed
    assert s["overall"] == {"passed": 2, "total": 2, "torch_fails": 0}


def test_chapter_2_quotes_the_committed_table():
    """Chapter 2 (its appendix's parity part) states the port's count; it must be the one the committed run printed."""
    root = Path(__file__).resolve().parents[1]
    whole = (root / "chapters" / "results" / "torch_suite.txt").read_text()
    table, _, fsdp2 = whole.partition(T.FSDP2_HEADER)  # FSDP1's section, then FSDP2's
    overall = re.search(r"^overall\s+(\d+) / (\d+)\s+(\d+)$", table, re.M)
    assert overall, "chapters/results/torch_suite.txt has no 'overall' line"
    passed, total, not_counted = overall.groups()
    listed = [line for line in table.splitlines() if line.startswith("  ")]
    assert len(listed) == int(not_counted), f"{len(listed)} not-counted cases listed, the table says {not_counted}"
    chapter = (root / "chapters" / "02_fsdp_core_deeper.md").read_text()
    assert f"passes {passed} of {total} cases" in chapter, "chapter 2's count is not the committed run's"
    assert f"The {not_counted} cases that torch FSDP1 itself fails" in chapter


def test_the_committed_fsdp2_table_lists_what_it_does_not_count():
    """The FSDP2 section of the committed table: its overall line sums its groups, and it lists exactly as many
    cases torch's fully_shard fails on CPU as it says it does not count."""
    root = Path(__file__).resolve().parents[1]
    _, header, fsdp2 = (root / "chapters" / "results" / "torch_suite.txt").read_text().partition(T.FSDP2_HEADER)
    assert header, "chapters/results/torch_suite.txt has no FSDP2 section"
    rows = re.findall(r"^(\w+)\s+(\d+) / (\d+)\s+(\d+)$", fsdp2, re.M)
    groups = [r for r in rows if r[0] != "overall"]
    overall = [r for r in rows if r[0] == "overall"]
    assert len(overall) == 1 and groups, rows
    assert [sum(int(r[i]) for r in groups) for i in (1, 2, 3)] == [int(x) for x in overall[0][1:]]
    listed = [line for line in fsdp2.splitlines() if line.startswith("  ")]
    assert len(listed) == int(overall[0][3]), f"{len(listed)} listed, the table says {overall[0][3]}"
