"""The answers to tasks 3.2a, 3.2b and 3.3 (``exercises/practice_tasks.py``).

3.2a is the train job's own schedule (``minifsdp.training.train.lr_factor``), written out.  3.2b reads a job's log
records in order and names each bad step by the first rule that fires; 3.3 sums a rank's trace spans by name.
"""

from __future__ import annotations

import math
import statistics

__all__ = ["lr_factor", "find_instability", "exposed_communication"]


def lr_factor(step: int, warmup: int, steps: int, schedule: str) -> float:
    """Task 3.2a: linear warm-up to 1 over ``warmup`` steps, then 1 (constant) or half a cosine down to 0."""
    if step < warmup:
        return (1 + step) / warmup
    if schedule != "cosine":
        return 1.0
    angle = math.pi * (step - warmup) / max(steps - warmup, 1)
    return (1.0 + math.cos(angle)) * 0.5


def find_instability(records: list[dict], jump: float = 3.0, window: int = 5) -> list[tuple[int, str]]:
    """Task 3.2b: ``[(step, reason)]`` for every bad step, in log order (the rules: the stub's docstring)."""
    bad: list[tuple[int, str]] = []
    for i, rec in enumerate(records):
        loss, norm = rec["loss"], rec["grad_norm"]
        if not math.isfinite(loss):
            bad.append((rec["step"], "loss is not finite"))
        elif not math.isfinite(norm):
            skipped = " (fp16: step skipped by the scaler)" if "loss_scale" in rec else ""
            bad.append((rec["step"], "grad norm is not finite" + skipped))
        else:
            earlier = [r for r in records[max(0, i - window):i] if math.isfinite(r["loss"] + r["grad_norm"])]
            for key in ("loss", "grad_norm") if earlier else ():
                median = statistics.median([r[key] for r in earlier])
                if median > 0 and rec[key] > jump * median:
                    bad.append((rec["step"], f"{key} jumped {rec[key] / median:.1f}x the median of the last "
                                             f"{len(earlier)}"))
                    break
    return bad


def exposed_communication(events: list[dict]) -> dict[str, float]:
    """Task 3.3: milliseconds of ``step``, ``all-gather`` and ``reduce-scatter`` waits, and their ``fraction``."""
    ms = {"step": 0.0, "all-gather": 0.0, "reduce-scatter": 0.0}
    prefixes = {"train step": "step", "minifsdp all-gather wait": "all-gather",
                "minifsdp reduce-scatter wait": "reduce-scatter"}
    for event in events:
        if event.get("ph") == "X":
            for prefix, key in prefixes.items():
                if event.get("name", "").startswith(prefix):
                    ms[key] += event["dur"] / 1000
    ms["fraction"] = (ms["all-gather"] + ms["reduce-scatter"]) / ms["step"] if ms["step"] > 0 else 0.0
    return ms
