"""Reference solution of project-noshard-accum (left out of the student edition): gradient accumulation
under ``no_sync()``, measured and predicted per micro-batch.

What one rank does over K micro-batches (units U_i of n_i numbers, N ranks, p_i = ceil(n_i / N))::

                      micro-batch 1 .. K-1 (inside no_sync)        micro-batch K (synced)
    FULL_SHARD        all-gather every unit in the forward,        the same all-gathers, then a
                      again (all but the root) in the backward     reduce-scatter of every unit
    SHARD_GRAD_OP     all-gather every unit once, in the first     no all-gather (the parameters are
                      forward; then the parameters stay whole      still whole), a reduce-scatter of every unit

    held after it     the accumulated gradients, whole: 4 sum(n_i)     the gradient shards: 4 sum(p_i)
                      (+ SHARD_GRAD_OP: the whole parameters, padded: 4 N sum(p_i))

A ring all-gather or reduce-scatter of a unit padded to N p_i numbers sends (N - 1) p_i of them.
"""

from __future__ import annotations

import contextlib
import time

from minifsdp.comm.counting import count_bytes
from minifsdp.memory.tracker import MemoryTracker

__all__ = ["accumulate", "measure", "predict"]


def accumulate(model, micro_batches, loss_fn, after_micro_batch=None) -> list[float]:
    k_total, losses = len(micro_batches), []
    for k, batch in enumerate(micro_batches):
        synced = k == k_total - 1
        with contextlib.nullcontext() if synced else model.no_sync():
            loss = loss_fn(model, batch) / k_total
            loss.backward()
        losses.append(loss.item())
        del loss
        if after_micro_batch is not None:
            after_micro_batch(k)
    return losses


def _settle(tracker, quiet_s: float = 0.05, limit_s: float = 2.0) -> None:
    """Wait until the tracker's count stays put for ``quiet_s``: gloo's worker thread drops the last
    reduce-scatter's input a moment after the backward has returned."""
    deadline = time.monotonic() + limit_s
    last, since = tracker.current_bytes, time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.005)
        if tracker.current_bytes != last:
            last, since = tracker.current_bytes, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            return


def measure(model, micro_batches, loss_fn) -> list[dict]:
    totals = []
    with count_bytes() as sent, MemoryTracker(model) as tracker:
        def after(k):
            totals.append(sent.sent)
            _settle(tracker)
            tracker.mark(f"after micro-batch {k}")

        accumulate(model, micro_batches, loss_fn, after)
    start, begin, out = tracker.timeline[0][1], 0.0, []  # the tracker's count at rest is the census's
    marks = [(name, t) for name, t in tracker.marks if name.startswith("after micro-batch")]
    for (name, end), total, before in zip(marks, totals, [0, *totals[:-1]], strict=True):
        out.append({"sent": total - before, "held": tracker.breakdown_at(name)["total"] - start,
                    "peak": max(b for t, b in tracker.timeline if begin <= t <= end) - start})
        begin = end
    return out


def predict(unit_numels, world_size, strategy, num_micro_batches, itemsize=4) -> list[dict]:
    if strategy not in ("FULL_SHARD", "SHARD_GRAD_OP"):
        raise ValueError(f"strategy is FULL_SHARD or SHARD_GRAD_OP, got {strategy!r}")
    n = world_size
    shards = [-(-numel // n) for numel in unit_numels]
    one_collective = [(n - 1) * p * itemsize for p in shards]  # an all-gather or a reduce-scatter of each unit
    forward = sum(one_collective)
    backward = forward - one_collective[0]  # the root keeps its parameters from its forward to its backward
    out = []
    for k in range(num_micro_batches):
        synced = k == num_micro_batches - 1
        if strategy == "FULL_SHARD":
            sent = forward + backward
        else:
            sent = forward if k == 0 else 0
        if synced:
            sent += forward  # one reduce-scatter per unit: the same bytes as its all-gather
            held = itemsize * sum(shards)
        else:
            held = itemsize * sum(unit_numels)
            if strategy == "SHARD_GRAD_OP":
                held += itemsize * n * sum(shards)
        out.append({"sent": sent, "held": held})
    return out
