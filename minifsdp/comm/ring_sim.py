"""The ring all-reduce, simulated in one process, every message recorded.

:func:`simulate_ring_all_reduce` takes N tensors (one per pretend rank), runs
the same schedule as :func:`minifsdp.comm.ring.ring_all_reduce` (and the tuned ring) -- the
same :func:`~minifsdp.comm.ring.chunk_bounds` and the same "which chunk at which step"
functions from :mod:`minifsdp.comm.ring` -- and returns a :class:`RingTrace`: the
result on every rank, one :class:`RingStep` per message, and a snapshot of
every rank's buffer after each step.  :func:`print_ring` renders it as text;
``minifsdp.pictures.plots`` draws it.

Within a step all ranks send at once, so every message of a step is read from
the buffers as they were *before* the step (a real ring does the same: it
sends, then adds what it received).

Note: the real collectives skip empty messages (when S < N); the simulation
records them anyway (``values == ()``), so every rank always has 2(N-1) steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from minifsdp.comm.ring import all_gather_chunks, chunk_bounds, reduce_scatter_chunks

__all__ = ["RingStep", "RingTrace", "simulate_ring_all_reduce", "print_ring"]

PHASES = ("reduce-scatter", "all-gather")


@dataclass(frozen=True)
class RingStep:
    """One message: ``sender`` sends chunk ``chunk`` to ``receiver`` at ``step`` of ``phase``."""

    phase: str  # "reduce-scatter" (receiver adds) or "all-gather" (receiver stores)
    step: int  # 0 .. N-2 within the phase
    sender: int
    receiver: int
    chunk: int  # index of the chunk (see chunk_bounds)
    values: tuple[float, ...]  # what travels
    contributors: tuple[int, ...]  # ranks whose data is summed into the message


@dataclass
class RingTrace:
    """Everything the simulation saw: ``states[t][r]`` is rank r's buffer after t global steps."""

    bounds: list[tuple[int, int]]
    steps: list[RingStep] = field(default_factory=list)
    states: list[list[torch.Tensor]] = field(default_factory=list)

    @property
    def world_size(self) -> int:
        return len(self.bounds)

    @property
    def results(self) -> list[torch.Tensor]:
        return self.states[-1]


def simulate_ring_all_reduce(tensors: list[torch.Tensor]) -> RingTrace:
    """Run a ring all-reduce (sum) over ``tensors`` (one per rank, same shape); record every step."""
    if not tensors:
        raise ValueError("simulate_ring_all_reduce needs at least one tensor (one per rank).")
    if any(t.shape != tensors[0].shape for t in tensors):
        raise ValueError(f"every rank's tensor must have the same shape, got {[tuple(t.shape) for t in tensors]}.")
    n = len(tensors)
    buffers = [t.detach().reshape(-1).clone() for t in tensors]
    bounds = chunk_bounds(buffers[0].numel(), n)
    # who[r][c]: the ranks whose contributions rank r's chunk c holds so far
    who = [[{r} for _ in range(n)] for r in range(n)]
    trace = RingTrace(bounds=bounds, states=[[b.clone() for b in buffers]])

    for phase, chunks_at in ((PHASES[0], reduce_scatter_chunks), (PHASES[1], all_gather_chunks)):
        for s in range(n - 1):
            messages = []
            for r in range(n):  # everyone sends first, from the buffers as they are now
                send_c, _ = chunks_at(r, n, s)
                piece = buffers[r][slice(*bounds[send_c])].clone()
                messages.append((r, (r + 1) % n, send_c, piece, set(who[r][send_c])))
            for sender, receiver, c, piece, contributors in messages:  # then everyone receives
                _, expected_c = chunks_at(receiver, n, s)
                assert expected_c == c, "the receiver expects the chunk the sender sends"
                target = buffers[receiver][slice(*bounds[c])]
                if phase == "reduce-scatter":
                    target.add_(piece)
                    who[receiver][c] |= contributors
                else:
                    target.copy_(piece)
                    who[receiver][c] = contributors
                trace.steps.append(RingStep(phase, s, sender, receiver, c, tuple(piece.tolist()),
                                            tuple(sorted(contributors))))
            trace.states.append([b.clone() for b in buffers])
    trace.states[-1] = [b.reshape(tensors[0].shape) for b in trace.states[-1]]
    return trace


def _fmt(buffer: torch.Tensor, bounds) -> str:
    def num(v: float) -> str:
        return f"{v:g}"

    return "[" + " | ".join(" ".join(num(v) for v in buffer[slice(*b)].tolist()) or "-" for b in bounds) + "]"


def print_ring(trace: RingTrace, show: bool = True) -> str:
    """Text picture of a :class:`RingTrace`: each step's messages and every rank's chunks after it."""
    n, bounds = trace.world_size, trace.bounds
    lines = [f"ring all-reduce on {n} ranks; chunks " + " ".join(f"c{i}=[{a}:{b}]" for i, (a, b) in enumerate(bounds))]
    lines.append("start")
    lines += [f"    rank {r}: {_fmt(trace.states[0][r], bounds)}" for r in range(n)]
    for t in range(2 * (n - 1)):
        phase, s = PHASES[t // (n - 1)], t % (n - 1)
        sends = [m for m in trace.steps if m.phase == phase and m.step == s]
        arrows = "   ".join(f"r{m.sender} -c{m.chunk}-> r{m.receiver}" for m in sends)
        verb = "adds" if phase == "reduce-scatter" else "stores"
        lines.append(f"{phase} step {s}: {arrows}   (receiver {verb})")
        lines += [f"    rank {r}: {_fmt(trace.states[t + 1][r].reshape(-1), bounds)}" for r in range(n)]
    lines.append(f"result on every rank: {trace.results[0].reshape(-1).tolist()}")
    text = "\n".join(lines)
    if show:
        print(text)
    return text
