"""The command line: ``python -m minifsdp compare`` and ``python -m minifsdp bench ...``."""

from __future__ import annotations

import argparse


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="minifsdp", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p_cmp = sub.add_parser("compare", help="train the tiny GPT with ours and torch's, side by side")
    p_cmp.add_argument("--strategy", choices=("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "ddp"),
                       default="FULL_SHARD",
                       help="FSDP strategy (ours vs torch FSDP1), or ddp (our DDP vs torch DDP)")
    p_cmp.add_argument("--world-size", type=int, default=2)
    p_cmp.add_argument("--steps", type=int, default=8)
    p_cmp.add_argument("--collectives", choices=("torch", "ring"), default="ring")
    p_cmp.add_argument("--optimizer", choices=("sgd", "adamw"), default="adamw")
    p_cmp.add_argument("--out", default="out", help="folder for the loss-curve PNG")

    p_bench = sub.add_parser("bench", help="measure ours against torch in the same run")
    p_bench.add_argument("what", choices=("collectives", "fsdp", "overlap", "precision"))
    p_bench.add_argument("--world-sizes", default="2,4")
    p_bench.add_argument("--max-mb", type=float, default=64.0, help="collectives: largest message")
    p_bench.add_argument("--json", default=None,
                         help="where to write the results (default out/bench_<what>.json; '' for none)")
    p_bench.add_argument("--config", default="bench", help="fsdp: TinyGPT size, bench (19M) | small | tiny")
    p_bench.add_argument("--steps", type=int, default=8, help="fsdp: timed steps per trainer (median)")
    p_bench.add_argument("--warmup", type=int, default=1, help="fsdp: untimed steps per trainer first")
    p_bench.add_argument("--batch-size", type=int, default=2,
                         help="fsdp: sequences of 128 tokens per rank per step (2 keeps a 2-core run near 6 min)")
    p_bench.add_argument("--trainers", default="ours_torch,ours_ring,fsdp1,fsdp2,ddp",
                         help="fsdp: which of ours_torch,ours_ring,fsdp1,fsdp2,ddp (fsdp1 is the reference)")
    p_bench.add_argument("--threads", type=int, default=1, help="overlap/precision: intra-op threads per rank")
    p_bench.add_argument("--link-ms", type=float, default=0.0,
                         help="overlap: simulated wire time per collective (ours only), to show what overlap hides")

    args = parser.parse_args(argv)
    if args.command == "compare":
        from minifsdp.compare import run_compare

        return run_compare(args)
    if args.command == "bench":
        if args.json is None:
            args.json = f"out/bench_{args.what}.json"
        if args.what == "collectives":
            from minifsdp.bench import run_collectives_bench

            return run_collectives_bench(args)
        if args.what in ("overlap", "precision"):
            from minifsdp.bench_overlap import run_bench

            return run_bench(args)
        from minifsdp.bench_fsdp import run_fsdp_bench

        return run_fsdp_bench(args)
    parser.error(f"unknown command {args.command}")
    return 2
