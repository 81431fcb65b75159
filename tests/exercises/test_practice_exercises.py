"""Grades tasks 3.2a, 3.2b, 3.3 (chapter 3): ``exercises/practice_tasks.py`` (``--impl=student``) or the
instructor's answer (the train job's own), run in the learner's process.

Oracles, independent of both implementations: 3.2a, values written out from the schedule's
definition (exact fractions for the warm-up, tolerance 1e-12 for the cosine: one float rounding
path against another); 3.2b, hand-made logs whose bad steps are known; 3.3, a hand-made trace whose
sums are known, with torch's own op names and instant events mixed in.
"""

import math

import pytest


def _fn(learner, task, name):
    return getattr(learner("practice_tasks"), name)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("task", ["3.2a"])
def test_task3_2a_warmup_then_cosine(learner, task):
    lr_factor = _fn(learner, task, "lr_factor")
    cases = [  # (step, warmup, steps, schedule, want)
        (0, 4, 40, "cosine", 0.25), (1, 4, 40, "cosine", 0.5), (3, 4, 40, "cosine", 1.0),
        (4, 4, 40, "cosine", 1.0), (22, 4, 40, "cosine", 0.5),  # halfway through the decay: cos(pi/2) = 0
        (39, 4, 40, "cosine", 0.5 * (1 + math.cos(math.pi * 35 / 36))),
        (13, 4, 40, "cosine", 0.5 * (1 + math.cos(math.pi * 9 / 36))),
        (0, 0, 10, "cosine", 1.0), (5, 0, 10, "cosine", 0.5), (10, 0, 10, "cosine", 0.0),
        (0, 4, 40, "constant", 0.25), (10, 4, 40, "constant", 1.0), (39, 4, 40, "constant", 1.0),
        (0, 0, 5, "constant", 1.0), (2, 3, 3, "cosine", 1.0), (3, 3, 3, "cosine", 1.0),
    ]
    fails = []
    for step, warmup, steps, schedule, want in cases:
        got = lr_factor(step, warmup, steps, schedule)
        if not isinstance(got, (int, float)) or abs(got - want) > 1e-12:
            fails.append(f"lr_factor(step={step}, warmup={warmup}, steps={steps}, {schedule!r}) = {got}, want {want}")
    assert not fails, f"Task {task} is not right yet:\n" + "\n".join(fails)


def _log(values, fp16=False):
    recs = [{"step": i + 1, "loss": loss, "grad_norm": norm} for i, (loss, norm) in enumerate(values)]
    if fp16:
        for r in recs:
            r["loss_scale"] = 65536.0
    return recs


NAN, INF = float("nan"), float("inf")
STEADY = [(4.0, 1.0), (3.9, 1.1), (3.8, 0.9), (3.7, 1.0), (3.6, 1.0), (3.5, 1.0)]
LOGS = {  # name: (records, jump, window, [(step, reason prefix)])
    "clean": (_log(STEADY), 3.0, 5, []),
    "loss spike at step 7": (_log(STEADY + [(12.0, 1.0), (3.4, 1.0)]), 3.0, 5, [(7, "loss jumped")]),
    "grad spike at step 7, named once": (_log(STEADY + [(3.5, 4.0)]), 3.0, 5, [(7, "grad_norm jumped")]),
    "loss first when both jump": (_log(STEADY + [(20.0, 9.0)]), 3.0, 5, [(7, "loss jumped")]),
    "NaN loss": (_log(STEADY[:3] + [(NAN, NAN), (3.5, 1.0)]), 3.0, 5, [(4, "loss is not finite")]),
    "inf grad without a scaler": (_log([(4.0, INF)] + STEADY), 3.0, 5, [(1, "grad norm is not finite")]),
    "fp16 overflow skipped": (_log([(4.0, NAN)] + STEADY, fp16=True), 3.0, 5,
                              [(1, "grad norm is not finite (fp16: step skipped by the scaler)")]),
    "a NaN does not poison the median": (_log(STEADY[:2] + [(NAN, 1.0), (3.8, 1.0), (13.0, 1.0)]), 3.0, 5,
                                         [(3, "loss is not finite"), (5, "loss jumped")]),
    "a non-finite grad norm keeps its loss out of the median": (
        _log([(1.0, 1.0), (100.0, INF), (100.0, INF), (3.5, 1.0)]), 3.0, 3,
        [(2, "grad norm is not finite"), (3, "grad norm is not finite"), (4, "loss jumped")]),
    "window: only the last 2": (_log([(1.0, 1.0), (10.0, 1.0), (10.0, 1.0), (25.0, 1.0)]), 3.0, 2,
                                [(2, "loss jumped")]),
    "jump threshold": (_log(STEADY + [(3.5 * 2.5, 1.0)]), 3.0, 5, []),
    "lower jump": (_log(STEADY + [(3.5 * 2.5, 1.0)]), 2.0, 5, [(7, "loss jumped")]),
    "first step cannot spike": (_log([(50.0, 50.0), (4.0, 1.0)]), 3.0, 5, []),
    "the record's step, not the index": ([{"step": 101, "loss": 4.0, "grad_norm": 1.0},
                                          {"step": 102, "loss": 40.0, "grad_norm": 1.0}], 3.0, 5,
                                         [(102, "loss jumped")]),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("task", ["3.2b"])
def test_task3_2b_instability_detector_names_the_step(learner, task):
    find_instability = _fn(learner, task, "find_instability")
    fails = []
    for name, (records, jump, window, want) in LOGS.items():
        got = find_instability(records, jump=jump, window=window)
        ok = isinstance(got, list) and len(got) == len(want) and all(
            isinstance(g, tuple) and g[0] == w[0] and str(g[1]).startswith(w[1]) for g, w in zip(got, want))
        if not ok:
            fails.append(f"{name}: got {got}, want steps and reasons starting {want}")
    assert not fails, f"Task {task} is not right yet:\n" + "\n".join(fails)


def _span(name, ts, dur):
    return {"ph": "X", "name": name, "ts": ts, "dur": dur, "pid": 0, "tid": 0}


TRACE = [
    _span("train step 2", 0, 10_000), _span("train step 3", 12_000, 8_000),      # 18 ms of steps
    _span("minifsdp forward root", 10, 3_000),
    _span("minifsdp all-gather wait blocks.0", 100, 1_500),                      # AG 1.5 + 0.5 + 1.0 = 3 ms
    _span("minifsdp all-gather wait blocks.1", 2_000, 500),
    _span("minifsdp all-gather wait root", 12_100, 1_000),
    _span("minifsdp reduce-scatter wait blocks.1", 8_000, 1_200),                 # RS 1.2 + 0.3 = 1.5 ms
    _span("minifsdp reduce-scatter wait root", 19_000, 300),
    _span("aten::mm", 200, 50), _span("gloo:all_gather", 150, 1_400), _span("ProfilerStep#2", 0, 10_000),
    {"ph": "i", "name": "minifsdp all-gather wait blocks.0", "ts": 5, "pid": 0, "tid": 0, "s": "t"},
    {"ph": "M", "name": "process_name", "pid": 0, "args": {"name": "rank 0"}},
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("task", ["3.3"])
def test_task3_3_exposed_communication_from_a_trace(learner, task):
    exposed = _fn(learner, task, "exposed_communication")
    fails = []
    for name, events, want in (
        ("two profiled steps", TRACE, {"step": 18.0, "all-gather": 3.0, "reduce-scatter": 1.5, "fraction": 4.5 / 18}),
        ("no step span", [e for e in TRACE if not e["name"].startswith("train step")],
         {"step": 0.0, "all-gather": 3.0, "reduce-scatter": 1.5, "fraction": 0.0}),
        ("no collectives", [_span("train step 5", 0, 2_000)],
         {"step": 2.0, "all-gather": 0.0, "reduce-scatter": 0.0, "fraction": 0.0}),
    ):
        got = exposed(events)
        if not isinstance(got, dict) or set(got) != set(want) or any(abs(got[k] - v) > 1e-9 for k, v in want.items()):
            fails.append(f"{name}: got {got}, want {want}")
    assert not fails, f"Task {task} is not right yet:\n" + "\n".join(fails)
