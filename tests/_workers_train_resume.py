"""Rank function for tests/test_train_resume.py: ``python -m minifsdp train``'s resume, every trainer, every precision.

For each (impl, precision) the job's own rank function (``minifsdp.training.train.train_worker``, with the
arguments the command line parses and checks) runs twice on these ranks:

    uninterrupted   steps 1..4, a checkpoint every 2 steps (step_2, step_4), final weights, a log of 4 lines
    crashed         the same folder as it is after a crash between steps 3 and 4's checkpoint: step_4 and
                    final gone, the log still holding the lines of steps 3 and 4 (they were written)
    --resume        loads step_2 (model, optimizer, scheduler, grad scaler, every rank's RNG), drops the log's
                    lines after step 2, trains steps 3 and 4, writes step_4 and the final weights

The resumed run's log (step, loss, lr, grad norm, loss scale) and its final weights must be bitwise the
uninterrupted run's.  A fresh model and optimizer are built for the resumed run and the global RNG is
re-seeded, as in a new process; the job reads nothing else from the first run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil

import torch
import torch.distributed as dist

from minifsdp.training.checks import check_args
from minifsdp.training.train import MODELS, add_arguments, train_worker

FLAGS = ["--world-size", "2", "--steps", "4", "--warmup", "1", "--schedule", "cosine", "--lr", "3e-3",
         "--dropout", "0.1", "--batch-size", "2", "--checkpoint-every", "2"]
KEYS = ("step", "loss", "lr", "grad_norm", "loss_scale")


def _args(flags: list[str]):
    """The command line's arguments for ``train`` ``flags``, checked as ``run_train`` checks them (job.json)."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(flags)
    if dist.get_rank() == 0:
        args.job = check_args(args, MODELS, False)  # completes args in place
    box = [args]
    dist.broadcast_object_list(box, src=0)  # rank 0 checked the folder (and wrote job.json) first
    return box[0]


def _log(path: str) -> list[dict]:
    with open(path) as f:
        return [{k: r.get(k) for k in KEYS} for r in map(json.loads, f) if r]


def _tensors(obj) -> list:
    """Every tensor in a loaded checkpoint object, in a fixed order (dict keys sorted)."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for k in sorted(obj, key=str) for t in _tensors(obj[k])]
    if isinstance(obj, (list, tuple)):
        return [t for x in obj for t in _tensors(x)]
    return []


def _final(run: str) -> list:
    return _tensors(torch.load(os.path.join(run, "final", "full.pt"), map_location="cpu", weights_only=False))


def resume_paths(root: str, paths: list[tuple[str, str]]) -> dict:
    """{(impl, precision): {"uninterrupted": log, "resumed": log, "resumed_from": step, "final_equal": bool,
    "scale_moved": bool}} (rank 0's view; every rank logs the same numbers)."""
    rank, out = dist.get_rank(), {}
    for impl, precision in paths:
        here = os.path.join(root, f"{impl}-{precision}")
        flags = [*FLAGS, "--impl", impl, *([] if precision == "fp32" else ["--mixed-precision", precision])]
        first, second = os.path.join(here, "uninterrupted"), os.path.join(here, "resumed")
        train_worker(_args([*flags, "--checkpoint-dir", first, "--log-json", os.path.join(first, "log.jsonl")]))
        dist.barrier()
        if rank == 0:  # the crash: the newest checkpoint and the final weights never got written
            shutil.copytree(first, second)
            shutil.rmtree(os.path.join(second, "step_00000004"))
            shutil.rmtree(os.path.join(second, "final"))
        dist.barrier()
        torch.manual_seed(12345)  # a new process's RNG would not be the first run's either
        resumed = train_worker(_args([*flags, "--checkpoint-dir", second, "--log-json",
                                      os.path.join(second, "log.jsonl"), "--resume"]))
        dist.barrier()
        if rank == 0:
            a, b = _final(first), _final(second)
            full = _log(os.path.join(first, "log.jsonl"))
            out[(impl, precision)] = {
                "uninterrupted": full, "resumed": _log(os.path.join(second, "log.jsonl")),
                "resumed_from": resumed["resumed_from"],
                "final_equal": len(a) == len(b) > 0 and all(x.dtype == y.dtype and torch.equal(x, y)
                                                            for x, y in zip(a, b)),
                "scale_moved": len({r["loss_scale"] for r in full[:3]}) > 1}
    return out
