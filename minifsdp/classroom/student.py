"""``python -m minifsdp train --impl student``: train with *your* exercise functions inside our FSDP.

The exercise tests grade a function on its own; this job makes the library run it where
it belongs.  It trains the tiny GPT twice on the same ranks, with the same flags, seed
and data: once with ``--impl ours``, once with your functions plugged into our FSDP
(``student_plugs.py`` says where each goes), and compares every step bitwise:

    python -m minifsdp train --impl student --steps 8              # every task below, from exercises/
    python -m minifsdp train --impl student --student 2.2,2.5      # only the tasks you have finished
    python -m minifsdp train --impl student --student reference    # minifsdp's own: what a pass looks like

    task   your functions (exercises/...)                          what FSDP uses them for
    2.1a   flatten_and_shard, unflatten       (fsdp_tasks.py)        each unit's local shard; its views
    2.2    ring_reduce_scatter, ring_all_gather, ring_all_reduce    every collective FSDP issues
                                              (ring_collectives.py)
    2.5    prefetch_target                    (overlap_tasks.py)     which unit the backward gathers early

A pass: every step's loss and global gradient norm are bitwise those of ``--impl ours``,
and every call gave the answer minifsdp's own function gives on the same inputs.  A
fail names the first step that differs and the first wrong call of each function
(rank, step, call, what differed), and says how to grade that task alone.  A stub
(``NotImplementedError``) stops the run with the task to finish.  ``--student
2.2=mypkg.ring`` takes a task's functions from another module.

Note (bitwise): at 2 ranks a ring sums two numbers per element, one rounding whatever
the order, so any correct ring gives our bits.  At 3 or more ranks the order of the
additions shows in the last bits: the exercise text prescribes the order ours uses.
Note (prefetch): a prefetch only moves when an all-gather starts, never the numbers,
so a wrong ``prefetch_target`` leaves the losses equal: the call-by-call watch catches it.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import sys

import torch
import torch.distributed as dist

from minifsdp.classroom.student_plugs import FUNCTIONS, Plug, StudentError, plug_into
from minifsdp.launch import RankFailedError, launched_by_torchrun, spawn
from minifsdp.models import CharCorpus, TinyGPT
from minifsdp.training.checks import JobError, check_args
from minifsdp.training.train import MODELS, build, train_step

__all__ = ["TASKS", "parse_student", "student_worker", "run_student", "add_student_argument"]

# task -> (the exercise module, minifsdp's reference, its functions)
TASKS = {
    "2.1a": ("exercises.fsdp_tasks", "exercises.solutions.fsdp_tasks", ("flatten_and_shard", "unflatten")),
    "2.2": ("exercises.ring_collectives", "minifsdp.comm.tuned",  # the textbook ring's twin, kept in the edition
            ("ring_reduce_scatter", "ring_all_gather", "ring_all_reduce")),
    "2.5": ("exercises.overlap_tasks", "minifsdp.fsdp.core.prefetch", ("prefetch_target",)),
}
WHAT = {
    "flatten_and_shard": "each unit's local shard (once, before step 1)",
    "unflatten": "the parameters as views of each gathered buffer",
    "ring_reduce_scatter": "every gradient reduce-scatter",
    "ring_all_gather": "every parameter all-gather",
    "ring_all_reduce": "every all-reduce (NO_SHARD; none in FULL_SHARD)",
    "prefetch_target": "which unit the backward gathers early",
}


def add_student_argument(p) -> None:
    p.add_argument("--student", default=None, metavar="TASKS",
                   help="--impl student: which exercise tasks to plug into our FSDP, comma-separated, of "
                        f"{', '.join(TASKS)} (default: all), each TASK or TASK=MODULE (MODULE 'reference': "
                        "minifsdp's own); 'reference' alone: every task from minifsdp")


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # its package is missing
        return False


def parse_student(spec: str | None) -> dict[str, str]:
    """``"2.2,2.5=mypkg.prefetch"`` -> {function name: module}; None: every task from exercises/."""
    items = [s.strip() for s in (spec or ",".join(TASKS)).split(",") if s.strip()]
    if items == ["reference"]:  # every task whose reference is here (the student edition has no exercises/solutions/)
        items = [f"{t}=reference" for t, (_, reference, _) in TASKS.items() if _importable(reference)]
    out: dict[str, str] = {}
    for item in items:
        task, _, module = item.partition("=")
        if task not in TASKS:
            raise JobError(f"--student {spec}: unknown task {task!r}; the tasks that run inside FSDP are "
                           f"{', '.join(TASKS)} (e.g. --student 2.2,2.5, or --student 2.2=mypkg.ring)")
        exercise, reference, functions = TASKS[task]
        module = {"": exercise, "exercises": exercise, "reference": reference}.get(module, module)
        out.update((f, module) for f in functions)
    return out


def _train(args, plug: Plug | None = None, mirror=None) -> list[tuple[float, float]]:
    """The train job's loop (``train.train_worker``'s, without logs and checkpoints): (loss, grad norm) per step."""
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = MODELS[args.model]()
    model, opt, sched, scaler = build(args)
    if plug is not None:
        plug_into(model, TinyGPT(cfg, seed=args.seed), plug, mirror)
    torch.manual_seed(1_000_003 * args.seed + rank)  # as train_worker: after wrapping, per rank
    corpus = CharCorpus(vocab_size=cfg.vocab_size)
    out = []
    for step in range(args.steps):
        x, y = corpus.batch(step, args.batch_size, cfg.block_size, rank, world)
        if plug is not None:
            plug.step = step + 1
        loss, norm = train_step(model, opt, scaler, x, y, args)
        dist.all_reduce(loss)
        loss = loss.item() / world
        sched.step(loss) if args.schedule == "plateau" else sched.step()
        out.append((loss, norm))
    return out


def student_worker(args, modules: dict[str, str]) -> dict:
    """One rank: ours, then the student's functions plugged in; the records, the calls and the wrong answers."""
    ours = _train(args)
    plug = Plug(modules)
    ring = {"ring_reduce_scatter", "ring_all_gather", "ring_all_reduce"} & set(modules)
    mirror = dist.new_group(list(range(dist.get_world_size()))) if ring else None  # the watch's own messages
    yours = _train(args, plug, mirror)
    return {"ours": ours, "yours": yours, "calls": dict(plug.calls), "wrong": plug.wrong}


def _same(a: float, b: float) -> bool:
    """Bitwise (``float.hex``: -0.0 is not 0.0), a NaN in both runs included."""
    return a.hex() == b.hex() or (math.isnan(a) and math.isnan(b))


def _table(ours, yours) -> tuple[list[str], int | None]:
    """The per-step lines and the first step (1-based) whose loss or grad norm differs, or None."""
    if len(ours) != len(yours):
        raise AssertionError(f"the two runs logged {len(ours)} and {len(yours)} steps")
    lines = [f"{'step':>5}  {'loss ours':>20}  {'loss yours':>20}  {'grad norm ours':>20}  "
             f"{'grad norm yours':>20}  equal"]
    differ = [i for i, ((lo, no), (ly, ny)) in enumerate(zip(ours, yours), 1) if not (_same(lo, ly) and _same(no, ny))]
    first = differ[0] if differ else None
    shown = set(range(1, 11)) | set(range(len(ours) - 2, len(ours) + 1)) | set(differ[:3])
    last = 0
    for i, ((lo, no), (ly, ny)) in enumerate(zip(ours, yours), 1):
        if i not in shown:
            continue
        if i > last + 1:
            lines.append(f"{'...':>5}")
        last = i
        lines.append(f"{i:>5}  {lo!r:>20}  {ly!r:>20}  {no!r:>20}  {ny!r:>20}  "
                     f"{'yes' if i not in differ else 'NO (loss)' if not _same(lo, ly) else 'NO (grad norm)'}")
    return lines, first


def report(results: list[dict], modules: dict[str, str]) -> tuple[str, bool]:
    """The plugged functions, the per-step table and the verdict; (text, passed)."""
    r0 = results[0]
    out = ["plugged into our FSDP (calls on rank 0):"]
    for f, module in modules.items():
        out.append(f"  {FUNCTIONS[f][0]:<5} {f:<20} {module:<30} {WHAT[f]:<48} {r0['calls'].get(f, 0):>6} calls")
    lines, first = _table(r0["ours"], r0["yours"])
    out += [""] + lines + [""]
    wrong = {}
    for rank, res in enumerate(results):
        for f, where in res["wrong"].items():
            wrong.setdefault(f, f"rank {rank}, {where}")
    if first is None and not wrong:
        out.append(f"PASS: your {', '.join(modules)} trained our FSDP bitwise like --impl ours, "
                   f"{len(r0['ours'])} steps, every call answered as ours does.")
        return "\n".join(out), True
    if first is not None:
        lo, ly = r0["ours"][first - 1][0], r0["yours"][first - 1][0]
        what = "the loss differs" if not _same(lo, ly) else \
            "the gradient norm differs (the loss follows at the next step)"
        out.append(f"FAIL at step {first}: {what} from --impl ours.")
    else:
        why = " (a prefetch only moves when an all-gather starts, never the numbers)" \
            if "prefetch_target" in wrong else ""
        out.append(f"FAIL: the losses and gradient norms agree{why}, but a function answered differently than ours:")
    if wrong:
        out.append("first wrong answer of each plugged function (the same inputs through minifsdp's own):")
        for f, where in wrong.items():
            task, text, grader = FUNCTIONS[f]
            out.append(f"  {f} (Task {task}, {modules[f]}): {where}")
            out.append(f"      grade it alone: {grader}   (text: {text})")
    else:
        out.append("no single call answered differently than ours: at 3 or more ranks a ring that adds in "
                   "another order than the exercise text's differs in the last bits; try --world-size 2")
    return "\n".join(out), False


def _student_message(e: Exception) -> str:
    """The StudentError's text (from a failed rank's traceback), or the whole traceback."""
    if isinstance(e, StudentError):
        return str(e)
    marker, detail = "StudentError: ", e.detail
    if marker not in detail:
        return str(e)
    text = detail[detail.index(marker) + len(marker):]
    return text.split("\n(rank ")[0].strip()  # launch.py appends "(rank k also failed: ...)" lines


def run_student(args: argparse.Namespace) -> int:
    """CLI entry: check the flags and imports, run both trainings on the ranks, print the comparison."""
    for flag, value in (("--checkpoint-dir", args.checkpoint_dir), ("--resume", args.resume),
                        ("--stop-after", args.stop_after), ("--profile", args.profile), ("--log-json", args.log_json)):
        if value:
            raise JobError(f"{flag} is not for --impl student (it compares two short runs and keeps nothing): drop it")
    if args.strategy == "HYBRID_SHARD":
        raise JobError("--impl student runs FULL_SHARD, SHARD_GRAD_OP or NO_SHARD (the ring exercises work on "
                       "every rank, not on HYBRID_SHARD's subgroups)")
    modules = parse_student(args.student)
    try:
        Plug(modules)  # a missing module or function fails here, before any rank starts
    except StudentError as e:
        raise JobError(str(e)) from e
    args.impl = "ours"  # both runs build our FSDP; the second gets the student's functions plugged in
    args.job = check_args(args, MODELS, launched_by_torchrun())
    say = not launched_by_torchrun() or os.environ.get("RANK") == "0"  # under torchrun: rank 0 prints
    if say:
        print(f"minifsdp train --impl student: TinyGPT-{args.model}, {args.world_size} ranks, {args.strategy}, "
              f"{args.steps} steps, trained with --impl ours and then with your functions", flush=True)
    try:
        results = spawn(student_worker, args=(args, modules), world_size=args.world_size,
                        timeout_s=120 + 2 * args.steps)
    except (RankFailedError, StudentError) as e:  # StudentError itself: under torchrun this process is a rank
        if say:
            print(f"minifsdp train --impl student: {_student_message(e)}", file=sys.stderr, flush=True)
        return 1
    text, passed = report(results, modules)
    if say:
        print(text, flush=True)
    return 0 if passed else 1
