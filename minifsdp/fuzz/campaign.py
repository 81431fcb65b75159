"""Many fuzz programs at once: draw them, run them in a few spawns, gather each program's differences.

    seeds S, S+1, ..., S+n-1 --draw--> programs --group by world size, batches of ``batch``-->
    one spawn per batch: every rank runs every program of it on torch, then on ours, and compares
    --> per program: the union of the ranks' differences --> ``known.explain``: a difference torch is
    wrong about is named (and a test pins it); anything else is a finding, shrunk and printed as a script

Why batches?  Starting ranks costs about a second; a program on the tiny models costs a fraction of one.
A batch that fails as a whole (a rank crashed) is run again one program per spawn, so the program at fault is
named and the others still count.  A program one of whose ranks raised while the others waited in a collective
leaves gloo's group unusable (it times out and closes the connections): that program runs again with each side
in a spawn of its own, and the programs after it in a fresh spawn.
"""

from __future__ import annotations

import dataclasses
import time

from minifsdp.fuzz.compare import differences
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


def run_batch(programs: list[Program], timeout_s: float | None = None) -> list[Outcome]:
    """Every program (all of one world size) in one spawn; on a failure of the whole spawn, one by one."""
    world = programs[0].world_size
    assert all(p.world_size == world for p in programs), "a batch is of one world size"
    timeout_s = timeout_s or 60.0 + 20.0 * len(programs)
    try:
        results = spawn(run_programs, ([p.to_json() for p in programs],), world_size=world, timeout_s=timeout_s)
    except RankFailedError:
        if len(programs) > 1:
            return [o for p in programs for o in run_batch([p])]
        return [_sides_apart(programs[0])]  # which side took the ranks down
    outcomes = []
    for i in range(min(len(r) for r in results)):
        if any("broken" in results[r][i] for r in range(world)):  # this program broke the group: apart
            outcomes.append(_sides_apart(programs[i]))
            break
        diffs = _merge([results[r][i] for r in range(world)])
        outcomes.append(Outcome(programs[i], diffs, explain(programs[i], diffs), errors=results[0][i]["errors"]))
    rest = programs[len(outcomes):]
    return outcomes + (run_batch(rest) if rest else [])


def _crash_line(e: Exception) -> str:
    """The blamed rank's last line ("rank 1 killed by signal SIGSEGV.", or its exception), not the lines that
    name the ranks which merely lost their peer after it ("(rank 2 also failed: ... Connection closed ...)")."""
    lines = [x for x in str(e).splitlines() if x.strip() and not x.startswith("(rank ")]
    return (lines[-1] if lines else str(e))[:300]


def _crashed(program: Program, e: Exception) -> Outcome:
    line = _crash_line(e)
    return Outcome(program, [("crash", "program", line)], {}, crash=line)


def _sides_apart(program: Program) -> Outcome:
    """A program one of whose sides left the process group unusable: each side in a spawn of its own, each
    rank's two records compared here (a rank raising while the others wait is then the same on both)."""
    records = {}
    for side in ("torch", "ours"):
        try:
            per_rank = spawn(run_programs, ([program.to_json()], (side,)), world_size=program.world_size,
                             timeout_s=120.0)
            records[side] = [r[0]["record"] for r in per_rank]
        except RankFailedError as e:  # a rank died (a signal): the side "raised" a crash at a step unknown
            line = _crash_line(e)
            crashed = {"wrapped": None, "steps": [], "final": None, "error": (None, "crash", line)}
            records[side] = [crashed] * program.world_size
    ops = [s["op"] for s in program.steps]
    diffs = _merge([{"differences": differences(o, t, ops)} for o, t in zip(records["ours"], records["torch"])])
    errors = {side: records[side][0]["error"] for side in records}
    return Outcome(program, diffs, explain(program, diffs), errors=errors)


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
