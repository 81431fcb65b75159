"""The command line: ``python -m minifsdp compare`` and ``python -m minifsdp bench ...``."""

from __future__ import annotations

import argparse


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="minifsdp", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p_cmp = sub.add_parser("compare", help="train the tiny GPT with ours and torch's, side by side")
    p_cmp.add_argument("--world-size", type=int, default=2)
    p_cmp.add_argument("--steps", type=int, default=8)
    p_cmp.add_argument("--collectives", choices=("torch", "ring"), default="ring")
    p_cmp.add_argument("--optimizer", choices=("sgd", "adamw"), default="adamw")
    p_cmp.add_argument("--out", default="out", help="folder for the loss-curve PNG")

    p_bench = sub.add_parser("bench", help="measure ours against torch in the same run")
    p_bench.add_argument("what", choices=("collectives",))
    p_bench.add_argument("--world-sizes", default="2,4")
    p_bench.add_argument("--max-mb", type=float, default=64.0)
    p_bench.add_argument("--json", default="out/bench_collectives.json")

    args = parser.parse_args(argv)
    if args.command == "compare":
        from minifsdp.compare import run_compare

        return run_compare(args)
    if args.command == "bench" and args.what == "collectives":
        from minifsdp.bench import run_collectives_bench

        return run_collectives_bench(args)
    parser.error(f"unknown command {args.command}")
    return 2
