"""``python -m minifsdp fuzz``: a campaign from the command line, with progress, a verdict, shrunk scripts.

    $ python -m minifsdp fuzz --cases 200 --seed 5000 --impl fsdp1 --shrink --out out/fuzz
    [  20/200  31 s] seed 5013: 1 difference  grads at step 2 (accum): blocks.0._flat_param: 3 of 40 ...
    ...
    200 programs (fsdp1, seeds 5000-5199) in 412 s: 197 equal to torch, 2 explained (torch is wrong:
    known.py), 1 unexplained -> out/fuzz/fsdp1_seed5013.py

The exit status is 1 while any difference is unexplained, so a script or CI can gate on it.
"""

from __future__ import annotations

import argparse
import collections
import json
import pathlib
import sys
import time

import torch

from minifsdp.fuzz.campaign import campaign
from minifsdp.fuzz.script import to_script
from minifsdp.fuzz.shrink import shrink

__all__ = ["fuzz_command", "add_arguments"]


def add_arguments(parser) -> None:
    parser.add_argument("--cases", type=_positive, default=50, help="how many programs (default 50)")
    parser.add_argument("--seed", type=_non_negative, default=0, help="the first program's seed (default 0)")
    parser.add_argument("--impl", choices=("fsdp1", "fsdp2"), default="fsdp1",
                        help="ours vs torch FSDP1 (fsdp1, default) or vs torch's fully_shard (fsdp2)")
    parser.add_argument("--batch", type=_positive, default=20, help="programs per spawn (default 20)")
    parser.add_argument("--shrink", action="store_true",
                        help="shrink each unexplained difference and write it as a script under --out")
    parser.add_argument("--out", default="out/fuzz", help="folder for shrunk scripts (default out/fuzz)")
    parser.add_argument("--record", default=None, help="write every program's verdict to this JSON file")


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}")
    return int(text)


def _non_negative(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"expected a whole number >= 0, got {text!r}")
    return int(text)


def _line(outcome) -> str:
    if outcome.crash:
        return f"crashed: {outcome.crash}"
    d = outcome.unexplained[0]
    n = len(outcome.unexplained)
    return f"{n} difference{'s' * (n > 1)}  {d[0]} at {d[1]}: {d[2][:110]}"


def fuzz_command(args, out=None) -> int:
    """Run the campaign ``args`` describes; print progress and a verdict; 1 if anything is unexplained."""
    out = sys.stdout if out is None else out  # read at call time: a test may have swapped it
    seeds = range(args.seed, args.seed + args.cases)
    every = max(1, args.cases // 10)

    def progress(done, total, outcome, elapsed):
        if not outcome.clean:
            print(f"[{done:>4}/{total} {elapsed:4.0f} s] seed {outcome.program.seed}: {_line(outcome)}", file=out,
                  flush=True)
        elif done % every == 0 or done == total:
            print(f"[{done:>4}/{total} {elapsed:4.0f} s] ...", file=out, flush=True)

    start = time.time()
    outcomes = campaign(seeds, args.impl, batch=args.batch, progress=progress)
    bad = [o for o in outcomes if not o.clean]
    explained = [o for o in outcomes if o.clean and o.explained]
    equal = len(outcomes) - len(bad) - len(explained)
    written = []
    if args.shrink and bad:
        folder = pathlib.Path(args.out)
        folder.mkdir(parents=True, exist_ok=True)
        for o in bad:
            field = o.unexplained[0][0]
            small = o.program if o.crash else shrink(o.program, field)
            path = folder / f"{args.impl}_seed{o.program.seed}.py"
            path.write_text(to_script(small, o.unexplained[0]))
            written.append(str(path))
            print(f"seed {o.program.seed} shrunk to: {small.summary()}\n  -> {path}", file=out, flush=True)
    if args.record:
        pathlib.Path(args.record).parent.mkdir(parents=True, exist_ok=True)
        pathlib.Path(args.record).write_text(json.dumps(_record(args, outcomes, equal, explained, bad, start),
                                                        indent=1))
    print(f"{len(outcomes)} programs ({args.impl}, seeds {seeds[0]}-{seeds[-1]}) in {time.time() - start:.0f} s: "
          f"{equal} equal to torch, {len(explained)} explained (torch is wrong: minifsdp/fuzz/known.py), "
          f"{len(bad)} unexplained" + (f" -> {', '.join(written)}" if written else ""), file=out, flush=True)
    return 1 if bad else 0


def _record(args, outcomes, equal: int, explained: list, bad: list, start: float) -> dict:
    """What a campaign's JSON keeps: the verdicts, and how many programs ran to their end on both sides (a fuzzer
    whose programs all raise compares nothing), with the exceptions both sides raised alike, by type."""
    both_raised = collections.Counter(f"{o.errors['torch'][1]}: {o.errors['torch'][2][:70]}" for o in outcomes
                                      if o.errors.get("torch") and o.errors.get("ours"))
    return {"impl": args.impl, "seeds": [args.seed, args.seed + args.cases - 1], "programs": len(outcomes),
            "equal": equal, "explained": {o.program.seed: sorted(set(o.explained.values())) for o in explained},
            "unexplained": {o.program.seed: [list(d) for d in o.unexplained] or [["crash", "", o.crash]]
                            for o in bad},
            "ran_every_step_on_both": sum(1 for o in outcomes if not any(o.errors.values())),
            "both_raised": dict(both_raised.most_common()),
            "by_world_size": dict(collections.Counter(str(o.program.world_size) for o in outcomes)),
            "torch": torch.__version__, "seconds": round(time.time() - start)}
