"""The route a reader's eye takes through the FSDP1 core in one training step (``python -m minifsdp route``).

Why measure it?  A learner reads the core by following the step: each function it calls, in the order it first
calls them.  Every time that order leaves one file for another, the reader turns to another file.  This tool
traces one step and prints that route, so "the step reads with few turns" is a number that a change can make
better or worse, not an impression.

The step: TinyGPT (two blocks), each block wrapped and the root around them, FULL_SHARD, BACKWARD_PRE, on CPU,
two ranks; rank 0's wrap (section 0 of ``fsdp.py``), its first ``model(x, y).backward()`` and ``opt.step()``.
Every function (method, property, hook) defined in ``minifsdp/fsdp/core/`` is a *stop* the first time it runs
(``sys.setprofile``; comprehensions and generator expressions belong to the function that holds them).  The route
is the stops in that order; a *visit* is a run of consecutive stops in one file; a *turn* (file switch) is the step
from one visit to the next, so turns = visits - 1.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Route:
    """The stops of a traced call, in first-call order: (file name, function's qualified name)."""
    stops: list[tuple[str, str]]

    @property
    def visits(self) -> list[tuple[str, list[str]]]:
        """Runs of consecutive stops in one file: (file, its functions)."""
        runs: list[tuple[str, list[str]]] = []
        for file, fn in self.stops:
            if runs and runs[-1][0] == file:
                runs[-1][1].append(fn)
            else:
                runs.append((file, [fn]))
        return runs

    @property
    def switches(self) -> int:
        return max(len(self.visits) - 1, 0)

    def text(self) -> str:
        lines = [f"{k:3d}  {file:<20} {', '.join(fns)}" for k, (file, fns) in enumerate(self.visits, 1)]
        files = sorted({f for f, _ in self.stops})
        entered = {f: sum(v == f for v, _ in self.visits) for f in files}
        lines.append(f"{len(self.stops)} functions in {len(files)} files; {len(self.visits)} visits, "
                     f"{self.switches} file switches")
        lines.append("entered: " + ", ".join(f"{f} {n}x" for f, n in sorted(entered.items(), key=lambda x: -x[1])))
        return "\n".join(lines)


def trace(fn, files) -> Route:
    """Run ``fn()`` and return the route through the functions defined in ``files`` (paths)."""
    files = {str(Path(f).resolve()) for f in files}
    seen, stops = set(), []

    def profile(frame, event, arg):
        code = frame.f_code
        if event == "call" and code not in seen and code.co_filename in files:
            seen.add(code)
            if not code.co_name.startswith("<") or code.co_name == "<lambda>":
                stops.append((Path(code.co_filename).name, code.co_qualname))

    old = sys.getprofile()
    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(old)
    return Route(stops)


def core_files() -> list[Path]:
    import minifsdp.fsdp.core as core

    return sorted(Path(core.__file__).parent.glob("*.py"))


def _step_route(rank: int, world: int) -> Route:
    """A spawn function: the traced step on this rank (every rank runs it, so the collectives match)."""
    import functools

    import torch

    from minifsdp.fsdp.core import FullyShardedDataParallel
    from minifsdp.fsdp.core.wrap import transformer_auto_wrap_policy
    from minifsdp.models import Block, CharCorpus, TinyGPT

    gpt, (x, y) = TinyGPT(seed=0), CharCorpus().batch(0, 2, 32, rank, world)

    def step():
        model = FullyShardedDataParallel(gpt, auto_wrap_policy=functools.partial(
            transformer_auto_wrap_policy, transformer_layer_cls={Block}))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model(x, y).backward()
        opt.step()
    return trace(step, core_files())


def step_route() -> Route:
    """Rank 0's route through one traced step (module docstring)."""
    from minifsdp.launch import spawn

    return spawn(_spawned, world_size=2)[0]


def _spawned() -> Route:
    import torch.distributed as dist

    return _step_route(dist.get_rank(), dist.get_world_size())


def main() -> int:
    print(step_route().text())
    return 0
