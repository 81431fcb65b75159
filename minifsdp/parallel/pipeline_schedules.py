"""Chapters 1 and 4.4: pipeline schedules, GPipe and 1F1B, mirroring ``torch.distributed.pipelining``'s.

A schedule decides in which order each stage runs the forwards (F) and backwards (B) of the micro-batches.
Every rank builds the same schedule around its own :class:`~minifsdp.parallel.pipelining.PipelineStage` (import
both from ``minifsdp.parallel.pipelining``, which re-exports this module, as ``torch.distributed.pipelining``) and
calls ``step`` with the whole batch, as torch's::

    if stage.is_first:   schedule.step(x)                          # x: (B, ...), cut into M micro-batches
    elif stage.is_last:  out = schedule.step(target=y, losses=losses)  # losses: one per micro-batch
    else:                schedule.step()

GPipe (fill, then drain), 3 stages, 4 micro-batches, one time unit per F or B ('.' is idle)::

    stage 0: F0  F1  F2  F3  .   .   .   .   B0  B1  B2  B3
    stage 1: .   F0  F1  F2  F3  .   .   B0  B1  B2  B3  .
    stage 2: .   .   F0  F1  F2  F3  B0  B1  B2  B3  .   .
             every stage holds the activations of all 4 micro-batches before its first B

1F1B (one forward, one backward), same sizes: S-1-s warm-up forwards on stage s, then F and B in turn::

    stage 0: F0  F1  F2  .   .   B0  F3  B1  .   B2  .   B3
    stage 1: .   F0  F1  .   B0  F2  B1  F3  B2  .   B3  .
    stage 2: .   .   F0  B0  F1  B1  F2  B2  F3  B3  .   .
             stage s holds at most S - s micro-batches (here 3, 2, 1) instead of M

Both leave the same share idle, the bubble (S-1)/(M+S-1) = 2/6 here (``bubble_fraction``); only more
micro-batches M shrink it.  The pictures are ``format_timeline(simulate_timeline("gpipe", 3, 4))``.

Note (loss and gradient scale, as torch's): the last stage computes ``loss_fn(output_m, target_m)`` per
micro-batch and backwards each one unscaled; the gradients add up across micro-batches in ``.grad``, and after
the last backward every stage divides its ``.grad`` by M once (``scale_grads=True``, torch's default).  With a
mean-reduced loss and equal micro-batches this is the gradient of the whole batch's mean loss; summation order
differs from one big backward, so it matches the unsharded model to rounding, and torch's schedule bitwise.
The division touches whatever ``.grad`` held before the step too, as torch's does: zero the gradients between
steps.  ``losses`` receives the M unscaled per-micro-batch losses.

Note (where we differ from torch on purpose): the batch must divide evenly into micro-batches (torch uses
``tensor_split`` and accepts uneven ones, which weights the micro-batch means unequally); a stage exchanges one
tensor with each neighbour; torch fuses a send with the next receive into one ``batch_isend_irecv`` while we
post every send with ``isend`` and block on each receive, which gives the same order of computation.
"""

from __future__ import annotations

from typing import Callable

import torch

__all__ = ["ScheduleGPipe", "Schedule1F1B", "PipelineScheduleSingle", "bubble_fraction",
           "measured_bubble_fraction", "action_order", "one_f_one_b_order", "simulate_timeline", "format_timeline"]


class PipelineScheduleSingle:
    """A schedule for one stage per rank: cut the batch, run this stage's :func:`action_order`, scale the grads.

    Args:
        stage: this rank's :class:`~minifsdp.parallel.pipelining.PipelineStage`.
        n_microbatches: M, the number of micro-batches a batch is cut into (along dim 0).
        loss_fn: ``loss_fn(output, target)`` on the last stage; None runs forwards only.
        scale_grads: divide the accumulated gradients by M after the step (torch's default, True).
    """

    schedule_name = ""

    def __init__(self, stage, n_microbatches: int, loss_fn: Callable | None = None,
                 scale_grads: bool = True):
        # duck-typed (this module cannot import pipelining.py, which re-exports it): any object with a stage's
        # methods and attributes will do
        needed = ("forward_one_chunk", "backward_one_chunk", "scale_grads", "wait_sends", "stage_index", "num_stages")
        if not all(hasattr(stage, a) for a in needed):
            raise TypeError(f"stage must be a minifsdp PipelineStage, got {type(stage).__name__}")
        if not isinstance(n_microbatches, int) or n_microbatches < 1:
            raise ValueError(f"n_microbatches must be a positive int, got {n_microbatches!r}")
        self._stage = stage
        self._n_microbatches = n_microbatches
        self._loss_fn = loss_fn
        self._has_backward = loss_fn is not None
        self.scale_grads = scale_grads
        self._num_stages = stage.num_stages

    def order(self) -> list[str]:
        """The actions this stage runs in one step, in order (``["F0", "F1", ..., "B0", ...]``)."""
        order = action_order(self.schedule_name, self._stage.stage_index, self._num_stages, self._n_microbatches)
        return order if self._has_backward else [a for a in order if a[0] == "F"]

    def step(self, *args, target=None, losses: list | None = None, **kwargs):
        """Run one step on the whole batch: ``step(x)`` on the first stage, ``step(target=y, losses=l)`` on the
        last, ``step()`` in between.  Returns the last stage's outputs (all micro-batches, concatenated along
        dim 0), None elsewhere.  As torch's, ``target`` and ``losses`` are ignored on the other stages, so code
        that passes them everywhere, written for torch, runs unchanged.
        """
        stage, M = self._stage, self._n_microbatches
        if kwargs:
            raise TypeError(f"step() got keyword arguments {sorted(kwargs)}: stages take one positional input")
        if stage.is_first:
            if len(args) != 1 or not isinstance(args[0], torch.Tensor):
                raise ValueError(f"step() on the first stage takes the batch: schedule.step(x), got {len(args)} "
                                 "positional arguments")
            x_mbs = self._split(args[0], "input")
        elif args:
            raise ValueError(f"step() got an input on stage {stage.stage_index}, which is not the first stage: "
                             f"it receives its input from stage {stage.stage_index - 1}; call schedule.step()"
                             + (" or step(target=..., losses=...) on the last stage" if stage.is_last else ""))
        else:
            x_mbs = [None] * M
        target_mbs = None
        if stage.is_last and self._has_backward:
            if target is None:
                raise ValueError("step() on the last stage needs the target for loss_fn: "
                                 "schedule.step(target=y, losses=losses)")
            target_mbs = self._split(target, "target")
        if self._has_backward and not torch.is_grad_enabled():
            raise RuntimeError("step() runs a backward: do not call it under torch.no_grad()")
        if losses is not None and not isinstance(losses, list):
            raise TypeError(f"losses must be a list, got {type(losses).__name__}")

        stage.has_backward = self._has_backward
        stage.clear_runtime_states()
        internal_losses: dict[int, torch.Tensor] = {}
        outputs: dict[int, torch.Tensor] = {}
        for action in self.order():
            kind, m = action[0], int(action[1:])
            if kind == "F":
                out = stage.forward_one_chunk(m, x_mbs[m])
                if stage.is_last:
                    outputs[m] = out.detach()  # keep no graph alive beyond the micro-batch's backward
                    if target_mbs is not None:
                        internal_losses[m] = self._loss_fn(out, target_mbs[m])
            else:
                stage.backward_one_chunk(m, loss=internal_losses.get(m))
        stage.wait_sends()
        if self._has_backward and self.scale_grads:
            stage.scale_grads(M)
        if stage.is_last and losses is not None and target_mbs is not None:
            losses.clear()
            losses.extend(internal_losses[m] for m in sorted(internal_losses))
        if stage.is_last:
            return torch.cat([outputs[m] for m in sorted(outputs)])
        return None

    def _split(self, t: torch.Tensor, what: str) -> list[torch.Tensor]:
        M = self._n_microbatches
        if t.dim() == 0 or t.shape[0] % M != 0:
            raise ValueError(f"the {what}'s batch dimension ({tuple(t.shape)[:1]}) must divide into "
                             f"n_microbatches={M} equal micro-batches along dim 0")
        return list(t.chunk(M, dim=0))


class ScheduleGPipe(PipelineScheduleSingle):
    """GPipe (Huang et al. 2019): all forwards of the micro-batches, then all their backwards (fill, drain)."""

    schedule_name = "gpipe"


class Schedule1F1B(PipelineScheduleSingle):
    """1F1B (PipeDream-flush, Narayanan et al. 2021): warm up, then alternate one forward and one backward.

    Stage s runs S-1-s forwards, then F and B in turn, then the remaining backwards; it never holds more than
    S - s micro-batches.  As torch's, it needs n_microbatches >= num_stages.
    """

    schedule_name = "1f1b"

    def __init__(self, stage, n_microbatches: int, loss_fn: Callable | None = None,
                 scale_grads: bool = True):
        super().__init__(stage, n_microbatches, loss_fn, scale_grads)
        if n_microbatches < self._num_stages:
            raise ValueError(f"Schedule1F1B needs n_microbatches ({n_microbatches}) >= the number of stages "
                             f"({self._num_stages}), as torch's")


# ---- schedules as orders of actions, and what they cost -------------------------------------------------
def action_order(schedule: str, stage_index: int, num_stages: int, n_microbatches: int) -> list[str]:
    """The order in which stage ``stage_index`` runs its forwards (F) and backwards (B) under ``schedule``.

    ``"gpipe"``: all forwards, then all backwards.  ``"1f1b"``: ``num_stages - stage_index - 1`` warm-up
    forwards, then one forward and one backward in turn, then the remaining backwards (cool-down).
    """
    S, M, i = num_stages, n_microbatches, stage_index
    if schedule == "gpipe":
        return [f"F{m}" for m in range(M)] + [f"B{m}" for m in range(M)]
    if schedule == "1f1b":
        return one_f_one_b_order(i, S, M)
    raise ValueError(f"unknown schedule {schedule!r}: 'gpipe' or '1f1b'")


# >>> student edition: cut; exercises/parallel_tasks.py runs here (task 4.4b)
def one_f_one_b_order(stage_index: int, num_stages: int, n_microbatches: int) -> list[str]:
    """1F1B's order on stage ``stage_index``: ``num_stages - stage_index - 1`` warm-up forwards, then one forward
    and one backward in turn, then the remaining backwards.  Refuses what torch's ``Schedule1F1B`` refuses."""
    S, M, i = num_stages, n_microbatches, stage_index
    if not 0 <= i < S:
        raise ValueError(f"stage_index {i} not in 0..{S - 1}")
    if M < S:
        raise ValueError(f"1F1B needs n_microbatches >= num_stages, got {M} < {S}")
    warmup = S - i - 1
    order = [f"F{m}" for m in range(warmup)]
    for m in range(M - warmup):
        order += [f"F{warmup + m}", f"B{m}"]
    return order + [f"B{m}" for m in range(M - warmup, M)]
# <<< student edition


def bubble_fraction(num_stages: int, n_microbatches: int) -> float:
    """The idle share of a stage's time in GPipe and in 1F1B when F and B take one unit each: (S-1)/(M+S-1).

    Each stage works 2M units out of 2(M+S-1): it waits S-1 units before its first forward and S-1 units
    after its last backward (mirror images).  1F1B has the same bubble; what it saves is memory (at most
    S - stage_index micro-batches in flight instead of M).
    """
    return (num_stages - 1) / (n_microbatches + num_stages - 1)


def measured_bubble_fraction(events_per_stage: list[list[tuple[str, float, float]]]) -> float:
    """The idle share measured from every stage's ``events``: 1 - busy / (stages x span of the whole step).

    The span runs from the first stage's first start to the last end anywhere (``time.time()`` stamps of
    processes on one machine share a clock).
    """
    spans = [e for events in events_per_stage for e in events]
    if not spans:
        raise ValueError("no events recorded")
    span = max(e[2] for e in spans) - min(e[1] for e in spans)
    busy = sum(e[2] - e[1] for e in spans)
    return 1.0 - busy / (len(events_per_stage) * span)


def simulate_timeline(schedule: str, num_stages: int, n_microbatches: int) -> list[list[str | None]]:
    """Each stage's time slots when every F and B takes one unit: a list per stage of action names or None (idle).

    A stage runs its :func:`action_order` one by one, each as soon as its input is there: F(s, m) after
    F(s-1, m); B(s, m) after B(s+1, m) (the last stage's after its own F(m)).
    """
    S = num_stages
    orders = [action_order(schedule, s, S, n_microbatches) for s in range(S)]
    done: dict[tuple[int, str], int] = {}  # (stage, action) -> slot in which it ran
    nxt, free, slots = [0] * S, [0] * S, [[] for _ in range(S)]
    while any(nxt[s] < len(orders[s]) for s in range(S)):
        progressed = False
        for s in range(S):
            if nxt[s] == len(orders[s]):
                continue
            a = orders[s][nxt[s]]
            dep = (s - 1, a) if a[0] == "F" and s > 0 else (s + 1, a) if a[0] == "B" and s < S - 1 else None
            if dep is not None and dep not in done:
                continue
            t = max(free[s], done[dep] + 1 if dep else 0)
            slots[s] += [None] * (t - len(slots[s])) + [a]
            done[(s, a)], free[s], nxt[s] = t, t + 1, nxt[s] + 1
            progressed = True
        if not progressed:
            raise RuntimeError(f"schedule {schedule!r} deadlocks: {[orders[s][nxt[s]:] for s in range(S)]}")
    width = max(len(row) for row in slots)
    return [row + [None] * (width - len(row)) for row in slots]


def format_timeline(slots: list[list[str | None]]) -> str:
    """ASCII rows ``stage s: F0 F1 .. B0`` of :func:`simulate_timeline`'s slots ('.' is idle)."""
    return "\n".join(f"stage {s}: " + " ".join(f"{a or '.':<3}" for a in row).rstrip() for s, row in enumerate(slots))
