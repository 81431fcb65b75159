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
    parser.add_argument("--merge", nargs="+", default=None, metavar="RECORD",
                        help="run nothing: merge the --record files of campaigns run in chunks into one verdict "
                             "(and one --record file)")


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
    if args.merge:
        return _merge_command(args, out)
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


def merge_records(records: list[dict]) -> dict:
    """One record from the records of campaigns run in chunks (one ``--record`` file each).

    A long campaign is run in chunks so that a stopped machine loses one chunk, not the campaign; the chunks
    must be of one implementation and one torch, and no seed may be counted twice."""
    if not records:
        raise ValueError("no records to merge")
    for key in ("impl", "torch"):
        values = sorted({r[key] for r in records})
        if len(values) > 1:
            raise ValueError(f"records of different {key}s ({', '.join(values)}): merge each {key} apart")
    ranges = sorted(tuple(r["seeds"]) for r in records)
    for (a0, a1), (b0, b1) in zip(ranges, ranges[1:]):
        if b0 <= a1:
            raise ValueError(f"seeds {a0}-{a1} and {b0}-{b1} overlap: a program would be counted twice")
    merged = {"impl": records[0]["impl"], "seeds": [list(r) for r in ranges],
              "programs": sum(r["programs"] for r in records), "equal": sum(r["equal"] for r in records),
              "explained": {}, "unexplained": {}, "ran_every_step_on_both": 0, "both_raised": collections.Counter(),
              "by_world_size": collections.Counter(), "torch": records[0]["torch"],
              "seconds": sum(r["seconds"] for r in records)}
    for r in records:
        merged["explained"].update(r["explained"])
        merged["unexplained"].update(r["unexplained"])
        merged["ran_every_step_on_both"] += r["ran_every_step_on_both"]
        merged["both_raised"].update(r["both_raised"])
        merged["by_world_size"].update(r["by_world_size"])
    merged["both_raised"] = dict(merged["both_raised"].most_common())
    merged["by_world_size"] = dict(sorted(merged["by_world_size"].items()))
    return merged


def _merge_command(args, out) -> int:
    paths = [pathlib.Path(p) for p in args.merge]
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise SystemExit(f"fuzz --merge: no such record file: {', '.join(missing)} (write them with --record)")
    try:
        merged = merge_records([json.loads(p.read_text()) for p in paths])
    except ValueError as e:
        raise SystemExit(f"fuzz --merge: {e}") from None
    if args.record:
        pathlib.Path(args.record).parent.mkdir(parents=True, exist_ok=True)
        pathlib.Path(args.record).write_text(json.dumps(merged, indent=1))
    print(f"{merged['programs']} programs ({merged['impl']}, {len(paths)} records) in {merged['seconds']} s: "
          f"{merged['equal']} equal to torch, {len(merged['explained'])} explained (torch is wrong: "
          f"minifsdp/fuzz/known.py), {len(merged['unexplained'])} unexplained", file=out, flush=True)
    return 1 if merged["unexplained"] else 0
