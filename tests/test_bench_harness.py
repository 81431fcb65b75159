"""The bench harness (minifsdp/bench/harness.py), the method every bench shares; no timing asserted.

* the contenders take turns, the order rotated each round, and warm-up rounds are not kept;
* with a CUDA device, ``torch.cuda.synchronize`` brackets every timed call (the GPU bench's path, here on a
  machine without a GPU: synchronize is recorded, the clock is a fake one);
* a median over the rounds, and a ratio is the contender over the reference: a slower one reads above 1;
* the table aligns headings with their columns and shows a missing figure as "-";
* a contender that raises is named in the error, in the rank and, on 2 ranks, in the parent (nothing hangs);
* on 2 ranks every time is the slowest rank's, and the ranks see the environment ``run_ranks`` gave them.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

from minifsdp.bench import harness as bench_harness
from minifsdp.bench.harness import ContenderError, add_ratios, choose, interleave, run_ranks, table, world_sizes
from minifsdp.launch import RankFailedError
from tests import _workers_bench_harness as w


def _fake_clock(monkeypatch, events: list) -> list:
    """The harness's clock made a number that only contenders move (``now[0] += seconds``); each reading logged."""
    now = [0.0]

    def perf_counter():
        events.append("clock")
        return now[0]

    monkeypatch.setattr(bench_harness, "time", SimpleNamespace(perf_counter=perf_counter, process_time=lambda: 0.0))
    return now


def test_contenders_take_turns_in_a_rotated_order_and_warmup_rounds_are_not_kept():
    calls = []
    timings = interleave({n: (lambda n=n: calls.append(n)) for n in "abc"}, rounds=2, warmup=1)
    assert calls == list("abc" + "bca" + "cab")  # none always first, none always last
    assert {n: len(t) for n, t in timings.wall.items()} == {"a": 2, "b": 2, "c": 2}
    assert {n: len(t) for n, t in timings.cpu.items()} == {"a": 2, "b": 2, "c": 2}


def test_every_timed_call_is_bracketed_by_cuda_synchronize(monkeypatch):
    events = []
    _fake_clock(monkeypatch, events)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: events.append(f"sync {device}"))
    contenders = {name: (lambda name=name: events.append(name)) for name in ("ours", "torch")}
    interleave(contenders, rounds=1, device=torch.device("cuda", 0))
    one = ["sync cuda:0", "clock", "{}", "sync cuda:0", "clock"]  # wait for the GPU, then read the clock
    assert events == [e.format("ours") for e in one] + [e.format("torch") for e in one]
    events.clear()
    interleave(contenders, rounds=1)  # on the CPU there is nothing to wait for
    assert events == ["clock", "ours", "clock", "clock", "torch", "clock"]


def test_medians_and_ratios_read_a_slower_contender_above_one(monkeypatch):
    now = _fake_clock(monkeypatch, [])
    seconds = {"ours": iter([0.030, 0.010, 0.050]), "fsdp1": iter([0.020, 0.020, 0.020])}

    def takes(name):
        def step():
            now[0] += next(seconds[name])
        return step

    timings = interleave({name: takes(name) for name in seconds}, rounds=3)
    assert timings.wall["ours"] == pytest.approx([0.030, 0.010, 0.050])
    assert timings.median("ours") == pytest.approx(0.030)
    rows = [{"world_size": 2, "trainer": name, "step_s": timings.median(name)} for name in seconds]
    rows.append({"world_size": 4, "trainer": "ours", "step_s": 0.1})  # no reference at 4 ranks
    add_ratios(rows, "step_s", "time_ratio", "fsdp1")
    assert [r["time_ratio"] for r in rows] == [pytest.approx(1.5), 1.0, None]
    assert bench_harness.spread(timings.wall["ours"]) == pytest.approx((0.050 - 0.010) / 0.030)


def test_table_aligns_headings_and_shows_a_missing_figure_as_a_dash():
    rows = [{"trainer": "ours", "time_ratio": 1.5}, {"trainer": "fsdp1", "time_ratio": None}]
    text = table(rows, [("trainer", "trainer", "<8"), ("x FSDP1", "time_ratio", ">8.3f"),
                        ("ms", lambda r: 12.0, ">5.1f")])
    assert text.splitlines() == ["trainer   x FSDP1    ms", "ours        1.500  12.0", "fsdp1           -  12.0"]


def test_a_failing_contender_is_named_with_its_round():
    calls = []

    def torch_step():
        calls.append(1)
        if len(calls) == 2:
            raise ValueError("no such tensor")

    with pytest.raises(ContenderError, match=r"bench contender 'torch' failed in round 2: ValueError: no such tensor"):
        interleave({"ours": lambda: None, "torch": torch_step}, rounds=3)


def test_options_are_checked_with_the_fix_in_the_message():
    assert world_sizes("2,4") == [2, 4] and world_sizes("1", smallest=1) == [1]
    with pytest.raises(SystemExit, match=r"--world-sizes must list sizes >= 2, e.g. 2,4; got '1,x'"):
        world_sizes("1,x")
    assert choose("fsdp1,ours", ("ours", "fsdp1"), "--trainers") == ["fsdp1", "ours"]
    with pytest.raises(SystemExit, match=r"--trainers: unknown \['fsdp3'\]; list some of ours,fsdp1, each once"):
        choose("ours,fsdp3", ("ours", "fsdp1"), "--trainers")
    with pytest.raises(SystemExit, match="each once"):
        choose("ours,ours", ("ours", "fsdp1"), "--trainers")


@pytest.mark.timeout(120)
def test_on_two_ranks_each_time_is_the_slowest_ranks_and_a_failure_names_the_contender(monkeypatch):
    monkeypatch.delenv("BENCH_HARNESS_PROBE", raising=False)
    out = run_ranks(w.slowest_rank_times, (0.05,), 2, timeout_s=60, env={"BENCH_HARNESS_PROBE": "seen"})
    (wall0, probe0), (wall1, probe1) = out
    assert wall0 == wall1, out  # one all-reduce (max) of every time: both ranks hold the same numbers
    assert len(wall0["ours"]) == 2 and min(wall0["ours"]) >= 0.05, out  # rank 1's sleep, not rank 0's nothing
    assert probe0 == probe1 == "seen" and "BENCH_HARNESS_PROBE" not in os.environ
    with pytest.raises(RankFailedError, match=r"(?s)rank 1 failed.*bench contender 'torch' failed in round 1: "
                                              r"RuntimeError: the reduce-scatter's output has the wrong shape"):
        run_ranks(w.torch_fails_on_rank_one, (), 2, timeout_s=60)
