"""The command line: ``python -m minifsdp compare``, ``train``, ``generate``, ``bench``, ``plan``, ``torch-suite``,
``course``, ``fuzz``, ``route``."""

from __future__ import annotations

import argparse
import sys

from minifsdp.comm import COLLECTIVE_KINDS
from minifsdp.training.devices import DeviceError, add_device_argument


def _threads(text: str) -> int | None:
    """``--threads``: a positive count, or 'default' (None: torch's own default, the number of cores)."""
    if text == "default":
        return None
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"--threads must be a count >= 1 or 'default', got {text!r}")
    return int(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="minifsdp", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p_cmp = sub.add_parser("compare", help="train the tiny GPT with ours and torch's, side by side")
    p_cmp.add_argument("--strategy", choices=("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "ddp"),
                       default="FULL_SHARD",
                       help="FSDP strategy (ours vs torch FSDP1), or ddp (our DDP vs torch DDP)")
    p_cmp.add_argument("--impl", choices=("fsdp1", "fsdp2"), default="fsdp1",
                       help="fsdp2: our per-parameter fully_shard vs torch's fully_shard (FULL_SHARD, "
                            "SHARD_GRAD_OP or HYBRID_SHARD)")
    p_cmp.add_argument("--world-size", type=int, default=2)
    p_cmp.add_argument("--steps", type=int, default=8)
    p_cmp.add_argument("--collectives", choices=COLLECTIVE_KINDS, default=None,
                       help="ours' collectives: 'ring' (tuned for gloo, the default on cpu), 'textbook' "
                            "(comm/ring.py) or 'torch' (torch.distributed's; the default on cuda)")
    p_cmp.add_argument("--optimizer", choices=("sgd", "adamw"), default="adamw")
    p_cmp.add_argument("--out", default="out", help="folder for the loss-curve PNG")
    add_device_argument(p_cmp)

    p_train = sub.add_parser("train", help="train the tiny GPT for real: progress, schedule, checkpoints, resume")
    from minifsdp.training.train import add_arguments

    add_arguments(p_train)
    from minifsdp.classroom.student import add_student_argument

    add_student_argument(p_train)  # --impl student: your exercise functions inside our FSDP (classroom/student.py)

    p_gen = sub.add_parser("generate", help="sample text from a train run's consolidated weights")
    from minifsdp.training.generate import add_arguments as add_generate_arguments

    add_generate_arguments(p_gen)

    p_bench = sub.add_parser("bench", help="measure ours against torch in the same run")
    p_bench.add_argument("what", choices=("collectives", "fsdp", "overlap", "precision", "scale"))
    p_bench.add_argument("--world-sizes", default=None, help="ranks per run, e.g. 2,4 (default 2,4; fsdp on cuda: 1)")
    p_bench.add_argument("--max-mb", type=float, default=64.0, help="collectives: largest message")
    p_bench.add_argument("--json", default=None,
                         help="where to write the results (default out/bench_<what>.json; '' for none)")
    p_bench.add_argument("--config", default=None,
                         help="fsdp: TinyGPT size, bench (19M, the default) | small | tiny; on cuda also 85m "
                              "(the default there) | 300m, or a list: 85m,300m")
    p_bench.add_argument("--steps", type=int, default=None,
                         help="timed steps (fsdp: 8 per trainer, median; on cuda 20, 300m 12; else 5)")
    p_bench.add_argument("--warmup", type=int, default=None,
                         help="fsdp: untimed steps per trainer first (1; on cuda 5, 300m 4)")
    p_bench.add_argument("--batch-size", type=int, default=None,
                         help="sequences per rank per step (fsdp: 2 of 128 tokens, a 2-core run in ~6 min; on cuda "
                              "85m 16, 300m 8; else 8)")
    p_bench.add_argument("--trainers", default=None,
                         help="fsdp: which of ours_torch,ours_ring,fsdp1,fsdp2,ours_fsdp2,ddp (all, the default; "
                              "fsdp1 is the reference; fsdp2 the second one, for ours_fsdp2); on cuda plain (the "
                              "unwrapped model) too, and no ours_ring")
    p_bench.add_argument("--precision", default=None,
                         help="fsdp on cuda: fp32 (default) | bf16 (MixedPrecision / MixedPrecisionPolicy with "
                              "param_dtype=bf16, reduce_dtype=fp32; autocast for plain and ddp), or fp32,bf16")
    add_device_argument(p_bench)
    p_bench.add_argument("--mem-limit-mb", type=float, default=2048.0, help="scale: per-rank limit (RLIMIT_AS)")
    p_bench.add_argument("--width", type=int, default=512, help="scale: TinyGPT n_embd (depth is searched)")
    p_bench.add_argument("--max-layers", type=int, default=256, help="scale: deepest model tried")
    p_bench.add_argument("--threads", type=_threads, default=1,
                         help="collectives/overlap/precision: intra-op threads per rank, or 'default' (torch's)")
    p_bench.add_argument("--collectives", default="ring",
                         help="collectives: which of ours against gloo, comma-separated: ring (tuned), textbook")
    p_bench.add_argument("--link-ms", type=float, default=0.0,
                         help="overlap: simulated wire time per collective (ours only), to show what overlap hides")

    from minifsdp.commands.plan import PARSER_OPTIONS as PLAN_OPTIONS
    from minifsdp.commands.plan import add_arguments as add_plan_arguments

    p_plan = sub.add_parser("plan", help="will it fit: memory, bytes and time per GPU at real scale, before a run",
                            **PLAN_OPTIONS)

    add_plan_arguments(p_plan)

    p_ts = sub.add_parser("torch-suite", help="run the ports of torch's FSDP1 and FSDP2 tests, a table per group")
    p_ts.add_argument("--suite", choices=("fsdp1", "fsdp2", "all"), default="all",
                      help="fsdp1: FullyShardedDataParallel's port; fsdp2: fully_shard's; default both")
    p_ts.add_argument("--group", default=None, help="one group of the suite (core, grad_acc, training, ...)")
    p_ts.add_argument("--fast", action="store_true", help="only the CI slice (cases marked fast)")
    p_ts.add_argument("--json", default="out/torch_suite.json", help="where to write the results ('' for none)")

    # course: run a class (the student edition, the grader with points, the find-the-bug lab)
    p_course = sub.add_parser("course", help="run a class: the student edition, the grader, the find-the-bug lab")
    from minifsdp.classroom.course import add_arguments as add_course_arguments

    add_course_arguments(p_course)

    # fuzz: random programs on torch's FSDP and on ours, compared bit for bit
    p_fuzz = sub.add_parser("fuzz", help="random but seeded FSDP programs, run on torch's and on ours, compared",
                            description="Draw programs from seeds (model trees, wrappings, every option, step "
                                        "sequences), run each on torch's FSDP and on ours in the same ranks, compare "
                                        "losses, gradients, parameters, dtypes, state dicts, collectives and "
                                        "exceptions bit for bit. Example: python -m minifsdp fuzz --cases 200 "
                                        "--seed 5000 --impl fsdp2 --shrink")
    from minifsdp.fuzz.command import add_arguments as add_fuzz_arguments

    add_fuzz_arguments(p_fuzz)

    sub.add_parser("route", help="the route one traced FSDP1 step takes through the core: files, functions, turns")

    args = parser.parse_args(argv)
    if args.command == "route":
        from minifsdp.pictures.route import main as route_main

        return route_main()
    if args.command == "fuzz":
        from minifsdp.fuzz.command import fuzz_command

        return fuzz_command(args)
    if args.command == "plan":
        from minifsdp.commands.plan import run_plan

        return run_plan(args)

    if args.command == "course":
        from minifsdp.classroom.course import run_course

        return run_course(args)
    if args.command == "torch-suite":
        from minifsdp.commands.torch_suite import run_torch_suite

        return run_torch_suite(args)
    if args.command in ("train", "generate"):
        from minifsdp.training.checks import JobError

        try:
            if args.command == "train" and args.student is not None and args.impl != "student":
                raise JobError(f"--student chooses what --impl student plugs in; drop it, or use --impl student "
                               f"(not {args.impl})")
            if args.command == "train" and args.impl == "student":
                from minifsdp.classroom.student import run_student

                return run_student(args)
            if args.command == "train":
                from minifsdp.training.train import run_train

                return run_train(args)
            from minifsdp.training.generate import run_generate

            return run_generate(args)
        except (JobError, DeviceError) as e:
            print(f"minifsdp {args.command}: error: {e}", file=sys.stderr)
            return 2
    try:
        return _run(parser, args)
    except DeviceError as e:  # --device asks for what this machine does not have: say so, no traceback
        print(f"minifsdp {args.command}: error: {e}", file=sys.stderr)
        return 2


def _run(parser, args) -> int:
    if args.command == "compare":
        from minifsdp.training.compare import run_compare

        return run_compare(args)
    if args.command == "bench":
        if args.what == "fsdp" and args.device == "cuda":
            from minifsdp.bench.fsdp_cuda import run_fsdp_bench_cuda

            return run_fsdp_bench_cuda(args)
        if args.device != "cpu" or args.precision is not None:
            raise DeviceError(f"bench {args.what}: --device cuda and --precision are for bench fsdp --device cuda; "
                              f"bench {args.what} runs on the CPU (drop them)")
        fsdp = args.what == "fsdp"
        defaults = {"world_sizes": "2,4", "config": "bench", "json": f"out/bench_{args.what}.json",
                    "trainers": "ours_torch,ours_ring,fsdp1,fsdp2,ours_fsdp2,ddp", "steps": 8 if fsdp else 5,
                    "warmup": 1 if fsdp else 2, "batch_size": 2 if fsdp else 8}
        for name, value in defaults.items():
            if getattr(args, name) is None:
                setattr(args, name, value)
        from minifsdp.bench import collectives, fsdp, overlap, scale

        return {"collectives": collectives.run_collectives_bench, "fsdp": fsdp.run_fsdp_bench,
                "overlap": overlap.run_bench, "precision": overlap.run_bench,
                "scale": scale.run_scale_bench}[args.what](args)  # scale: ddp, ours, fsdp1; 4 ranks unless given
    parser.error(f"unknown command {args.command}")
    return 2
