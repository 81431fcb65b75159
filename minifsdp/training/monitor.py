"""Reading a training job's outputs: the first bad step of a log, and the exposed communication of a trace.

Two questions a user asks after ``python -m minifsdp train`` (chapter 3):

* **Where did the run go wrong?**  :func:`find_instability` reads the ``--log-json`` records
  (one dict per step: ``step``, ``loss``, ``grad_norm``, and ``loss_scale`` under fp16) and names
  every step that is bad, in order:

      loss not finite                 fatal: the weights are probably NaN already
      grad norm not finite            fp16 (the record has loss_scale): the scaler skipped the step;
                                      otherwise fatal
      loss or grad norm > jump x      a spike: the median of the previous ``window`` finite steps
      the recent median

* **How much of a step waited for communication?**  :func:`exposed_communication` reads the
  Chrome trace that ``--profile`` writes per rank (``rank{r}.json``) and sums the spans our FSDP
  units name ``minifsdp all-gather wait <unit>`` and ``minifsdp reduce-scatter wait <unit>``
  against the ``train step N`` spans:

      train step 2   |------------------------------------------|
      AG wait            [==]        [=]                           exposed: the compute thread
      RS wait                                  [====]              blocked on a collective

Note (what "exposed" means): a wait span is time the compute thread could not proceed; a
collective that finished while another unit computed leaves no wait.  On a machine whose cores
are shared, a wait also contains the time the *other* rank was not scheduled.

These are the reference solutions of exercises 3.2 and 3.3 (``exercises/practice_tasks.py``).
"""

from __future__ import annotations

import math
import statistics

__all__ = ["find_instability", "exposed_communication"]


# >>> student edition: cut; exercises/practice_tasks.py runs here (tasks 3.2b, 3.3)
def find_instability(records: list[dict], jump: float = 3.0, window: int = 5) -> list[tuple[int, str]]:
    """``[(step, reason)]`` for every bad step of a job's log, in log order.

    ``reason`` starts with one of ``"loss is not finite"``, ``"grad norm is not finite"``
    (``"... (fp16: step skipped by the scaler)"`` when the record has ``loss_scale``),
    ``"loss jumped"`` or ``"grad_norm jumped"``.  A spike compares a step with the median of the
    previous ``window`` records whose loss and grad norm are both finite (none yet: no spike);
    the loss is tested before the grad norm, and a step is named once.
    """
    found: list[tuple[int, str]] = []
    for i, rec in enumerate(records):
        if not math.isfinite(rec["loss"]):
            found.append((rec["step"], "loss is not finite"))
            continue
        if not math.isfinite(rec["grad_norm"]):
            why = " (fp16: step skipped by the scaler)" if "loss_scale" in rec else ""
            found.append((rec["step"], "grad norm is not finite" + why))
            continue
        recent = [r for r in records[max(0, i - window):i]
                  if math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"])]
        if not recent:
            continue
        for key in ("loss", "grad_norm"):
            ref = statistics.median(r[key] for r in recent)
            if ref > 0 and rec[key] > jump * ref:
                found.append((rec["step"], f"{key} jumped {rec[key] / ref:.1f}x the median of the last {len(recent)}"))
                break
    return found


def exposed_communication(events: list[dict]) -> dict[str, float]:
    """Milliseconds of one rank's trace: ``step``, ``all-gather``, ``reduce-scatter``, and ``fraction``.

    ``events`` is the ``traceEvents`` list of a Chrome trace (``ph == "X"`` spans, ``dur`` in
    microseconds).  ``step`` sums the ``train step N`` spans; the two waits sum the spans named
    ``minifsdp all-gather wait ...`` and ``minifsdp reduce-scatter wait ...``; ``fraction`` is
    (both waits) / step (0 when there is no step span).  Other events are ignored.
    """
    total = {"step": 0.0, "all-gather": 0.0, "reduce-scatter": 0.0}
    for e in events:
        if e.get("ph") != "X":
            continue
        name = e.get("name", "")
        if name.startswith("train step"):
            total["step"] += e["dur"] / 1e3
        for kind in ("all-gather", "reduce-scatter"):
            if name.startswith(f"minifsdp {kind} wait"):
                total[kind] += e["dur"] / 1e3
    waits = total["all-gather"] + total["reduce-scatter"]
    total["fraction"] = waits / total["step"] if total["step"] > 0 else 0.0
    return total
# <<< student edition
