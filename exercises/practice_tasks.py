"""Tasks 3.2a, 3.2b, 3.3: read what a training job does and writes (chapter 3, FSDP in practice).

Fill in :func:`lr_factor` (3.2a), :func:`find_instability` (3.2b) and
:func:`exposed_communication` (3.3).  The task text and hints are in
``exercises/README_practice.md``.  Grade with::

    pytest tests/exercises/test_practice_exercises.py --impl=student

No process group is needed: each function works on numbers or on what the job wrote
(its ``--log-json`` records, its ``--profile`` trace).

Reference solution: ``lr_factor`` in ``minifsdp/training/train.py`` and the two functions of
``minifsdp/training/monitor.py``; do not peek before you have tried.
"""

from __future__ import annotations

import math  # noqa: F401  (you will need it)
import statistics  # noqa: F401  (you may want it for 3.2b)


def lr_factor(step: int, warmup: int, steps: int, schedule: str) -> float:
    """Task 3.2a.  The multiplier of the peak learning rate at 0-based ``step``.

    Linear warm-up over the first ``warmup`` steps (step 0 gets 1/warmup, step warmup-1 gets 1),
    then ``schedule == "constant"``: 1; ``schedule == "cosine"``: half a cosine from 1 at step
    ``warmup`` down towards 0 at step ``steps`` (the run's total length, the schedule's horizon).
    """
    raise NotImplementedError("Task 3.2a: lr_factor -- see exercises/README_practice.md")


def find_instability(records: list[dict], jump: float = 3.0, window: int = 5) -> list[tuple[int, str]]:
    """Task 3.2b.  ``[(step, reason)]`` for every bad step of a job's log, in log order.

    Each record is one line of ``--log-json``: ``step``, ``loss``, ``grad_norm`` (and
    ``loss_scale`` under fp16).  A step is named at most once, by the first rule that fires:

    1. the loss is not finite:        reason starts with ``"loss is not finite"``;
    2. the grad norm is not finite:   ``"grad norm is not finite"``, plus
       ``" (fp16: step skipped by the scaler)"`` when the record has ``loss_scale``;
    3. the loss, else the grad norm, exceeds ``jump`` x the median of that value over the
       previous ``window`` records whose loss and grad norm are both finite (none: no spike):
       reason starts with ``"loss jumped"`` or ``"grad_norm jumped"``.
    """
    raise NotImplementedError("Task 3.2b: find_instability -- see exercises/README_practice.md")


def exposed_communication(events: list[dict]) -> dict[str, float]:
    """Task 3.3.  How long one rank's profiled steps waited for communication, in milliseconds.

    ``events`` is a Chrome trace's ``traceEvents`` (what ``--profile`` writes per rank). Use only
    complete spans (``ph == "X"``; ``dur`` in microseconds).  Return
    ``{"step": ..., "all-gather": ..., "reduce-scatter": ..., "fraction": ...}``: the summed
    durations of spans named ``train step ...``, ``minifsdp all-gather wait ...`` and
    ``minifsdp reduce-scatter wait ...``, and (both waits) / step, or 0.0 without a step span.
    """
    raise NotImplementedError("Task 3.3: exposed_communication -- see exercises/README_practice.md")
