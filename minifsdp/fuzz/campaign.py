"""Many fuzz programs at once: draw them, run them in a few spawns, gather each program's differences.

    seeds S, S+1, ..., S+n-1 --draw--> programs --group by world size, batches of ``batch``-->
    one spawn per batch: every rank runs every program of it on torch, then on ours, and compares
    --> per program: the union of the ranks' differences --> ``known.explain``: a difference torch is
    wrong about is named (and a test pins it); anything else is a finding, shrunk and printed as a script

Why batches?  Starting ranks costs about a second; a program on the tiny models costs a fraction of one.
A batch that fails as a whole (a rank crashed, a hang hit the timeout) is run again one program per spawn, so
the program at fault is named and the others still count.
"""

from __future__ import annotations

import dataclasses
import time

from minifsdp.fuzz.known import explain
from minifsdp.fuzz.program import Program, draw
from minifsdp.fuzz.run import run_programs
from minifsdp.launch import RankFailedError, spawn

__all__ = ["Outcome", "run_batch", "campaign"]


@dataclasses.dataclass
class Outcome:
    """One program's verdict: ``differences`` (every rank's, each once), the ones ``known`` explains, and
    ``crash`` (a batch of one that failed: the rank's error, first line)."""
    program: Program
    differences: list
    explained: dict
    crash: str | None = None
    # rank 0's (step, exception type, first line) for each side that raised, None for one that ran every step
    errors: dict = dataclasses.field(default_factory=dict)

    @property
    def unexplained(self) -> list:
        return [d for d in self.differences if d not in self.explained]

    @property
    def clean(self) -> bool:
        return self.crash is None and not self.unexplained


def _merge(per_rank: list[dict]) -> list:
    seen, out = set(), []
    for r in per_rank:
        for d in r["differences"]:
            d = tuple(d)
            if d[:2] + (d[2].split(":")[0],) not in seen:
                seen.add(d[:2] + (d[2].split(":")[0],))
                out.append(d)
    return out


def run_batch(programs: list[Program], timeout_s: float = 240.0) -> list[Outcome]:
    """Every program (all of one world size) in one spawn; on a failure of the whole spawn, one by one."""
    world = programs[0].world_size
    assert all(p.world_size == world for p in programs), "a batch is of one world size"
    try:
        results = spawn(run_programs, ([p.to_json() for p in programs],), world_size=world, timeout_s=timeout_s)
    except RankFailedError as e:
        if len(programs) > 1:
            return [o for p in programs for o in run_batch([p], timeout_s=min(timeout_s, 120.0))]
        line = next((x for x in reversed(str(e).splitlines()) if x.strip()), str(e))
        return [Outcome(programs[0], [("crash", "program", line[:300])], {}, crash=line[:300])]
    outcomes = []
    for i, program in enumerate(programs):
        diffs = _merge([results[r][i] for r in range(world)])
        outcomes.append(Outcome(program, diffs, explain(program, diffs), errors=results[0][i]["errors"]))
    return outcomes


def campaign(seeds, impl: str = "fsdp1", batch: int = 20, progress=None) -> list[Outcome]:
    """Draw a program from each seed, run them all, return their outcomes in seed order.

    ``progress(done, total, outcome)`` is called after each program (the command prints a line)."""
    programs = [draw(s, impl) for s in seeds]
    by_world: dict[int, list[Program]] = {}
    for p in programs:
        by_world.setdefault(p.world_size, []).append(p)
    results: dict[int, Outcome] = {}
    done, start = 0, time.time()
    for world in sorted(by_world):
        group = by_world[world]
        for lo in range(0, len(group), batch):
            for outcome in run_batch(group[lo: lo + batch]):
                results[outcome.program.seed] = outcome
                done += 1
                if progress is not None:
                    progress(done, len(programs), outcome, time.time() - start)
    return [results[p.seed] for p in programs]
