"""The train job's input checks: every bad flag is refused before a rank starts, and nothing is lost.

Each message names the problem and the fix.  ``check_args`` runs in the launching
process (under torchrun, in every rank, before any collective) and returns the
job's record, kept as ``<checkpoint-dir>/job.json``:

    fresh run   the folder must hold no checkpoint (a run there would be overwritten):
                use --resume, or another folder
    --resume    the folder must hold a complete checkpoint and a job.json whose
                numbers-shaping flags (model, steps, lr, schedule, ...) equal this run's;
                another world size is accepted (minifsdp.checkpoint reshards), but its
                RNG states cannot be mapped rank to rank: not bitwise then (a warning says so)

Note (root): permission bits do not stop root, so writability is tested by
writing a probe file, which also catches a path under a regular file.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
from dataclasses import asdict

__all__ = ["JobError", "check_args", "checkpoint_steps", "read_job"]

JOB_FILE = "job.json"
# flags that change the numbers of the run: a resume must repeat them
SHAPING = ("model", "gpt_config", "steps", "batch_size", "lr", "weight_decay", "clip", "warmup", "schedule",
           "dropout", "seed", "mixed_precision")


class JobError(ValueError):
    """A flag or a file the job cannot use; the message says what to do instead."""


def checkpoint_steps(root: str, impl: str) -> list[int]:
    """The complete checkpoints of ``root``, by step: ours have a manifest, torch's their one file."""
    if not os.path.isdir(root):
        return []
    if impl == "ours":
        from minifsdp.checkpoint import CheckpointManager

        return CheckpointManager(root).steps()
    found = [re.fullmatch(r"step_(\d+)", n) for n in os.listdir(root)]
    return sorted(int(m.group(1)) for m in found
                  if m and os.path.exists(os.path.join(root, m.group(0), "torch_full.pt")))


def read_job(root: str) -> dict | None:
    path = os.path.join(root, JOB_FILE)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def _writable(path: str, flag: str) -> None:
    probe = os.path.join(path, f".minifsdp_write_test_{os.getpid()}")
    try:
        os.makedirs(path, exist_ok=True)
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as e:
        raise JobError(f"{flag} {path}: cannot write there ({type(e).__name__}: {e.strerror or e}); "
                       f"choose a folder you can write to") from None


def _need(ok: bool, message: str) -> None:
    if not ok:
        raise JobError(message)


def _check_numbers(args, torchrun: bool) -> None:
    if torchrun:
        world = int(os.environ["WORLD_SIZE"])
        _need(args.world_size in (None, world), f"--world-size {args.world_size} but torchrun started {world} ranks: "
              "drop --world-size under torchrun (it takes torchrun's)")
        args.world_size = world
    elif args.world_size is None:
        args.world_size = 2
    _need(args.world_size >= 1, f"--world-size must be at least 1, got {args.world_size}")
    _need(args.steps >= 1, f"--steps must be at least 1 (the run's total length), got {args.steps}")
    _need(args.batch_size >= 1, f"--batch-size must be at least 1 sequence per rank, got {args.batch_size}")
    _need(math.isfinite(args.lr) and args.lr > 0, f"--lr must be a positive number, got {args.lr}")
    _need(math.isfinite(args.clip) and args.clip >= 0, f"--clip must be >= 0 (0: no clipping), got {args.clip}")
    _need(0 <= args.dropout < 1, f"--dropout must be in [0, 1), got {args.dropout}")
    _need(args.weight_decay >= 0, f"--weight-decay must be >= 0, got {args.weight_decay}")
    _need(0 <= args.warmup < args.steps, f"--warmup must be in [0, --steps) = [0, {args.steps}), got {args.warmup}")
    _need(not (args.schedule == "plateau" and args.warmup), "--warmup applies to --schedule constant and cosine; "
          "plateau lowers the lr when the loss stops improving: drop --warmup or pick cosine")
    _need(args.checkpoint_every >= 1, f"--checkpoint-every must be at least 1 step, got {args.checkpoint_every}")
    if args.stop_after is not None:
        _need(1 <= args.stop_after <= args.steps, f"--stop-after {args.stop_after} is beyond the run: it must be in "
              f"[1, --steps] = [1, {args.steps}] (--steps is the whole run, --stop-after ends this process early)")
        _need(args.checkpoint_dir is not None, "--stop-after without --checkpoint-dir would throw the run away: "
              "add --checkpoint-dir DIR (then --resume continues it)")


def _check_impl(args) -> None:
    if args.impl != "ours":
        _need(args.collectives is None, f"--collectives chooses our collectives; --impl {args.impl} uses torch's own: "
              "drop --collectives")
    elif args.collectives is None:  # our ring moves gloo's CPU tensors; on GPUs the collectives are NCCL's
        args.collectives = "ring" if getattr(args, "device", "cpu") == "cpu" else "torch"
    _need(not (getattr(args, "device", "cpu") == "cuda" and args.collectives != "torch"), "--collectives "
          f"{args.collectives} is our ring on gloo's CPU tensors; with --device cuda the collectives are NCCL's: "
          "use --collectives torch (the default there), or --device cpu")
    if args.strategy == "HYBRID_SHARD":
        _need(args.world_size >= 4 and args.world_size % 2 == 0, "--strategy HYBRID_SHARD shards inside pairs of "
              f"ranks and replicates across pairs: it needs an even world size >= 4, got {args.world_size}")
    if args.impl == "torch-fsdp2":
        _need(args.strategy in ("FULL_SHARD", "SHARD_GRAD_OP"), f"--impl torch-fsdp2 (fully_shard) has no "
              f"{args.strategy} here: use FULL_SHARD (reshard after forward) or SHARD_GRAD_OP (keep until backward)")


def _job_record(args, models) -> dict:
    job = {k: getattr(args, k) for k in SHAPING if k != "gpt_config"}
    job.update(gpt_config=asdict(models[args.model]()), impl=args.impl, world_size=args.world_size,
               strategy=args.strategy)
    return job


def _check_resume(args, job: dict) -> None:
    root = args.checkpoint_dir
    _need(root is not None, "--resume needs --checkpoint-dir DIR, the folder the stopped run wrote its checkpoints to")
    saved = read_job(root)
    steps = checkpoint_steps(root, saved["impl"] if saved else args.impl)
    _need(saved is not None and bool(steps), f"--resume: no checkpoint to resume from in {root} (no job.json and "
          "complete step_* folder there); run without --resume to start, or point --checkpoint-dir at the run")
    _need(saved["impl"] == args.impl, f"--resume: {root} was written by --impl {saved['impl']}, whose checkpoint "
          f"format --impl {args.impl} cannot read; resume with --impl {saved['impl']}")
    _need(saved["gpt_config"] == job["gpt_config"], f"--resume: the checkpoint in {root} holds another model "
          f"(--model {saved['model']}: {saved['gpt_config']}) than this run builds (--model {args.model}: "
          f"{job['gpt_config']}); its parameters have other shapes and cannot be loaded or resharded: "
          f"resume with --model {saved['model']}, or start a new run in another --checkpoint-dir")
    differ = [f"--{k.replace('_', '-')} {saved[k]} (checkpoint) vs {job[k]} (now)" for k in SHAPING
              if k != "gpt_config" and saved.get(k) != job[k]]
    _need(not differ, f"--resume: these flags differ from the run in {root}: " + "; ".join(differ)
          + ". A resume must repeat them (they shape the numbers; --steps is the schedule's horizon); "
          "to change them, start a new run in another --checkpoint-dir")
    job["resume_step"] = steps[-1]
    _need(steps[-1] < args.steps, f"--resume: the run in {root} is finished (step {steps[-1]} of {args.steps}); "
          f"its weights are in {os.path.join(root, 'final')}")
    if args.stop_after is not None:
        _need(args.stop_after > steps[-1], f"--stop-after {args.stop_after}: the run resumes after step {steps[-1]}, "
              "so it must be larger")
    if saved["world_size"] != args.world_size:
        print(f"warning: the checkpoint was written by {saved['world_size']} ranks, resuming on {args.world_size}: "
              "the shards are re-cut (resharded) and the data stays the same, but the per-rank RNG states cannot "
              "be carried over, so the losses will not be bitwise those of the uninterrupted run", file=sys.stderr)


def check_args(args, models: dict, torchrun: bool) -> dict:
    """Validate and complete ``args`` in place; returns the job record (written to job.json on a fresh run)."""
    _check_numbers(args, torchrun)
    _check_impl(args)
    job = _job_record(args, models)
    for flag, path in (("--profile", args.profile),
                       ("--log-json", os.path.dirname(os.path.abspath(args.log_json)) if args.log_json else None)):
        if path is not None:
            _writable(path, flag)
    if args.log_json and os.path.isdir(args.log_json):
        raise JobError(f"--log-json {args.log_json} is a folder; give a file name, e.g. {args.log_json}/log.jsonl")
    if args.resume:
        _check_resume(args, job)
        return job
    if args.checkpoint_dir is None:
        return job
    _writable(args.checkpoint_dir, "--checkpoint-dir")
    for impl in ("ours", "torch-fsdp1"):
        found = checkpoint_steps(args.checkpoint_dir, impl)
        _need(not found, f"--checkpoint-dir {args.checkpoint_dir} already holds a run's checkpoints (step "
              f"{found[-1] if found else 0}); add --resume to continue it, or choose an empty folder (nothing "
              "was overwritten)")
    if os.environ.get("RANK", "0") == "0":
        from minifsdp.checkpoint.files import atomic_write_bytes

        atomic_write_bytes(os.path.join(args.checkpoint_dir, JOB_FILE), json.dumps(job, indent=1).encode())
    return job
