"""A training job that survives a rank being killed: checkpoint every 2 steps, resume from the last one.

Run it under torchrun with restarts (what tests/test_fault_tolerance.py does):

    python -m torch.distributed.run --standalone --nproc-per-node 2 --max-restarts 1 \\
        tests/_train_resumable.py OUTDIR --kill-at 5

    attempt 0:  steps 0 1 [save 2] 2 3 [save 4] 4 5 -> rank 1: SIGKILL
                torchrun sees a dead worker, stops the other, starts both again
    attempt 1:  load step_4 (model, AdamW state, RNG, data position) -> steps 4 5 [save 6] 6 7 [save 8]

The kill happens on the first attempt only (a marker file in OUTDIR says it
already happened).  Every step masks a random tenth of the inputs with the
global torch RNG, so a resume that forgot the RNG state would drift.  Rank 0
writes ``OUTDIR/result.pt``: the final full state dict and the losses of the last attempt.
The same :func:`train` runs under ``minifsdp.spawn`` too (the test's no-failure oracle).
"""

from __future__ import annotations

import argparse
import functools
import os
import signal

import torch
import torch.distributed as dist
import torch.nn.functional as F

import minifsdp
from minifsdp import checkpoint
from minifsdp.checkpoint import resume
from minifsdp.fsdp import FSDP
from minifsdp.fsdp.torch_options import size_based_auto_wrap_policy
from minifsdp.models import MLP

STEPS, EVERY = 8, 2
DIMS = (16, 32, 32, 8)


def train(outdir: str, kill_at: int | None = None) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(1000 + rank)
    model = FSDP(MLP(DIMS, seed=0), auto_wrap_policy=functools.partial(size_based_auto_wrap_policy, min_num_params=500))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    mgr = checkpoint.CheckpointManager(os.path.join(outdir, "ckpt"), keep=2)
    extra = mgr.load_latest(model, opt)
    start = 0
    if extra is not None:
        resume.restore_rng(extra["rng"])
        start = extra["step"]
    losses = {}
    data = MLP(DIMS)
    for step in range(start, STEPS):
        x, y = data.batch(step, 4, rank, world)
        x = torch.where(torch.rand(x.shape) < 0.1, torch.zeros_like(x), x)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses[step] = loss.item()
        if kill_at is not None and step == kill_at and rank == 1:
            marker = os.path.join(outdir, "killed_once")
            if not os.path.exists(marker):
                open(marker, "w").close()
                os.kill(os.getpid(), signal.SIGKILL)  # no exception, no cleanup: as a crash
        if (step + 1) % EVERY == 0:
            mgr.save(step + 1, model, opt, extra={"step": step + 1, "rng": resume.capture_rng()})
    full = {k: v.numpy().copy() for k, v in checkpoint.full_state_dict(model).items()}
    result = {"full": full, "losses": losses, "resumed_from": start,
              "restarts": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)), "kept": mgr.steps()}
    if rank == 0 and minifsdp.launch.launched_by_torchrun():
        torch.save(result, os.path.join(outdir, "result.pt"))
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("outdir")
    parser.add_argument("--kill-at", type=int, default=None)
    args = parser.parse_args()
    minifsdp.spawn(train, args=(args.outdir, args.kill_at), world_size=2)
