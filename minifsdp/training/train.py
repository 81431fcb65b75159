"""The training job: ``python -m minifsdp train`` trains the tiny GPT the way a real run does.

Why a job and not a notebook cell: a real run is long, so it shows progress (a tqdm
bar on rank 0), writes a log a program can read (``--log-json``: one JSON line per
step), follows a learning-rate schedule, clips by the *global* gradient norm,
checkpoints every K steps, survives being stopped, and leaves weights to serve.

    python -m minifsdp train --world-size 2 --steps 200 --checkpoint-dir run --log-json run/log.jsonl
    torchrun --nproc-per-node 2 -m minifsdp train --steps 200 ...     (the same command, the same losses)
    python -m minifsdp generate --checkpoint run --prompt "FSDP "

A run of S = 8 steps, ``--checkpoint-every 3``, stopped with ``--stop-after 5``, then resumed:

    step:        1    2    3    4    5 | 6    7    8
    first run:   ---- ---- ---- ---- ----X                  X = --stop-after 5 ends here
    checkpoints:             [3]      [5]                   step_3, step_5 (the newest 2 kept)
    --resume:                          load step_5 -> 6 ---- 7 ---- 8 -> [8] + final/full.pt
                                       model shards, AdamW state, LR scheduler, grad scaler,
                                       every rank's RNG, data position (= the step: a batch is
                                       a pure function of (step, rank))
    log:         losses of steps 6..8 are bitwise those of the run that never stopped

One step on every rank (``train_step``):

    batch(step, rank) -> forward -> backward -> clip (global norm) -> optimizer -> scheduler
                                                                     (plateau: on the loss
                                                                      averaged over ranks)

Note (the schedule's horizon): ``--steps`` is the whole run's length, the cosine
decay ends there; ``--stop-after`` only ends this process early.  Resuming with
other values of the flags that shape the numbers (steps, lr, schedule, model...)
would not continue *this* run, so it is refused (``job.json`` records them).

Note (ranks agree): every rank logs the same loss (all-reduced mean), the same grad
norm (the global one) and the same lr; ReduceLROnPlateau is stepped with the
all-reduced loss, else each rank would cut its learning rate at another step.
"""

from __future__ import annotations

import functools
import json
import math
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from minifsdp.comm import COLLECTIVE_KINDS
from minifsdp.launch import launched_by_torchrun, spawn
from minifsdp.models import CharCorpus, GPTConfig, TinyGPT
from minifsdp.training import impls
from minifsdp.training.checks import JobError, check_args, checkpoint_steps
from minifsdp.training.devices import add_device_argument, rank_device, resolve_device

__all__ = ["run_train", "train_worker", "lr_factor", "add_arguments", "JobError", "MODELS"]

MODELS = {"tiny": GPTConfig.tiny, "mini": GPTConfig.mini, "small": GPTConfig.small}
STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD")
PLATEAU = dict(factor=0.5, patience=10)  # halve the lr after 10 steps without a new best loss


def add_arguments(p) -> None:
    """The flags of ``python -m minifsdp train`` (cli.py adds the subcommand)."""
    p.add_argument("--world-size", type=int, default=None, help="local ranks (default 2; under torchrun its own)")
    add_device_argument(p)
    p.add_argument("--model", choices=tuple(MODELS), default="tiny",
                   help="TinyGPT size (tiny ~30k, mini ~0.2M, small ~0.8M)")
    p.add_argument("--steps", type=int, default=200, help="the run's total length: the schedule's horizon")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per rank per step")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (AdamW)")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--clip", type=float, default=1.0, help="clip the global gradient norm to this (0: no clipping)")
    p.add_argument("--warmup", type=int, default=0, help="steps of linear warm-up (constant and cosine)")
    p.add_argument("--schedule", choices=("constant", "cosine", "plateau"), default="cosine")
    p.add_argument("--dropout", type=float, default=0.1,
                   help="dropout on each block's attention and MLP output (the job's use of the RNG)")
    p.add_argument("--seed", type=int, default=0, help="model init; rank r's RNG starts from (seed, r)")
    p.add_argument("--impl", choices=impls.IMPLS, default="ours")
    p.add_argument("--strategy", choices=STRATEGIES, default="FULL_SHARD")
    p.add_argument("--collectives", choices=COLLECTIVE_KINDS, default=None,
                   help="ours only: our ring tuned for gloo ('ring', the default), the textbook ring "
                        "('textbook', comm/ring.py) or torch.distributed's ('torch')")
    p.add_argument("--mixed-precision", choices=tuple(impls.DTYPES), default=None)
    p.add_argument("--activation-checkpointing", action="store_true")
    p.add_argument("--checkpoint-dir", default=None)
    p.add_argument("--checkpoint-every", type=int, default=50)
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --checkpoint-dir")
    p.add_argument("--stop-after", type=int, default=None, help="end this process after step K (as a preemption)")
    p.add_argument("--log-json", default=None, help="one JSON line per step (rank 0)")
    p.add_argument("--profile", default=None, help="folder for one Chrome trace per rank (2 steps profiled)")


def lr_factor(step: int, warmup: int, steps: int, schedule: str) -> float:
    """The multiplier of the peak lr for 0-based ``step``: linear warm-up, then constant or cosine to 0.

        warm-up   step < W:   (step + 1) / W
        constant  after:      1
        cosine    after:      0.5 * (1 + cos(pi * (step - W) / (S - W)))
    """
    if step < warmup:
        return (step + 1) / warmup
    if schedule == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))
    return 1.0


def _scheduler(opt, args):
    if args.schedule == "plateau":
        return torch.optim.lr_scheduler.ReduceLROnPlateau(opt, **PLATEAU)
    return torch.optim.lr_scheduler.LambdaLR(opt, functools.partial(
        lr_factor, warmup=args.warmup, steps=args.steps, schedule=args.schedule))


def _add_dropout(model: TinyGPT, p: float) -> None:
    """Residual dropout (GPT-2's resid_pdrop) on each block's two branches, as forward hooks.

    Hooks on the plain model's submodules, so all three impls (and activation
    checkpointing's recompute, which replays the RNG) see the same ops.
    """
    if p <= 0:
        return

    def drop(module, inputs, out):
        return F.dropout(out, p, training=module.training)

    for block in model.blocks:
        block.attn.register_forward_hook(drop)
        block.mlp.register_forward_hook(drop)


def build(args, device: torch.device | None = None):
    """The wrapped model (on ``device``, default CPU), AdamW over its (sharded) parameters, the scheduler and the
    fp16 scaler."""
    device = device if device is not None else torch.device("cpu")
    model = TinyGPT(MODELS[args.model](), seed=args.seed).to(device)
    _add_dropout(model, args.dropout)
    model = impls.wrap(model, args, device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    return model, opt, _scheduler(opt, args), impls.make_scaler(args)


def train_step(model, opt, scaler, x, y, args):
    """Forward, backward, clip, optimizer step; returns (this rank's loss, the global grad norm)."""
    loss = model(x, y)
    if scaler is not None:
        scaler.scale(loss).backward()
        scaler.unscale_(opt)  # clip the true gradients, not the scaled ones
    else:
        loss.backward()
    norm = impls.clip(model, args)
    if scaler is not None:
        scaler.step(opt)  # skipped (on every rank) when any shard overflowed
        scaler.update()
    else:
        opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach().float(), norm


# ---------------------------------------------------------------------- checkpoints
def _step_dir(args, step: int) -> str:
    return os.path.join(args.checkpoint_dir, f"step_{step:08d}")


def _save(args, step, model, opt, sched, scaler, mgr) -> None:
    from minifsdp.checkpoint.resume import capture_rng

    extra = {"step": step, "world_size": dist.get_world_size(), "rng": capture_rng(), "scheduler": sched.state_dict(),
             "scaler": scaler.state_dict() if scaler is not None else None}
    if mgr is not None:  # ours: minifsdp.checkpoint, sharded, the newest 2 kept
        mgr.save(step, model, opt, extra=extra)
        return
    impls.save_torch_checkpoint(_step_dir(args, step), model, opt, extra)
    if dist.get_rank() == 0:
        import shutil

        for old in checkpoint_steps(args.checkpoint_dir, args.impl)[:-2]:
            shutil.rmtree(_step_dir(args, old), ignore_errors=True)
    dist.barrier()


def _load(args, model, opt, sched, scaler, mgr) -> int:
    """Load the newest checkpoint (model, optimizer, scheduler, scaler, RNG); returns the next step."""
    from minifsdp.checkpoint.resume import restore_rng

    if mgr is not None:
        extra = mgr.load_latest(model, opt)
    else:
        extra = impls.load_torch_checkpoint(_step_dir(args, checkpoint_steps(args.checkpoint_dir, args.impl)[-1]),
                                            model, opt)
    sched.load_state_dict(extra["scheduler"])
    if scaler is not None and extra["scaler"] is not None:
        scaler.load_state_dict(extra["scaler"])
    if extra.get("world_size", dist.get_world_size()) == dist.get_world_size():
        restore_rng(extra["rng"])  # another world size: rank r's generator had no counterpart
    return extra["step"]


def _save_final(args, model) -> None:
    """The consolidated weights for ``generate``: a plain state dict in ``final/full.pt`` (rank 0)."""
    final = os.path.join(args.checkpoint_dir, "final")
    if args.impl == "ours":
        from minifsdp import checkpoint

        checkpoint.save(final, model, None, full=True, overwrite=True, extra={"job": args.job})
        return
    full = impls.full_weights(model, args.impl)
    if dist.get_rank() == 0:
        from minifsdp.checkpoint.files import save_object

        os.makedirs(final, exist_ok=True)
        save_object(os.path.join(final, "full.pt"), {"model": full, "extra": [{"job": args.job}]})
    dist.barrier()


# ---------------------------------------------------------------------- the loop
def _open_log(args, start: int):
    """Rank 0's JSON-lines log; on resume, keep the lines before the resumed step (drop a crash's extras)."""
    kept = []
    if args.resume and os.path.exists(args.log_json):
        with open(args.log_json) as f:
            kept = [line for line in f if line.strip() and json.loads(line)["step"] <= start]
    f = open(args.log_json, "w")
    f.writelines(kept)
    f.flush()
    return f


def train_worker(args) -> dict:
    """One rank of the job; returns its per-step records (every rank logs the same numbers)."""
    from tqdm import tqdm

    rank, world = dist.get_rank(), dist.get_world_size()
    device = rank_device(getattr(args, "device", "cpu"))  # --device cuda: this rank's GPU
    model, opt, sched, scaler = build(args, device)
    torch.manual_seed(1_000_003 * args.seed + rank)  # after wrapping: ranks draw different dropout masks
    mgr = None
    if args.checkpoint_dir is not None and args.impl == "ours":
        from minifsdp.checkpoint import CheckpointManager

        mgr = CheckpointManager(args.checkpoint_dir, keep=2)
    start = _load(args, model, opt, sched, scaler, mgr) if args.resume else 0
    stop = args.stop_after or args.steps
    cfg, corpus = model_cfg(args), CharCorpus(vocab_size=MODELS[args.model]().vocab_size)
    log = _open_log(args, start) if (rank == 0 and args.log_json) else None
    bar = tqdm(total=args.steps, initial=start, disable=rank != 0, file=sys.stderr, desc=f"train {args.impl}",
               dynamic_ncols=True, mininterval=0.5)
    profiled = set(range(start + 1, stop)[:2]) or {start}  # 2 steps after the first (its allocations)
    prof = tracer = None
    records = []
    for step in range(start, stop):
        if args.profile and step == min(profiled):
            prof, tracer = _start_profile(model, args)
        x, y = (t.to(device) for t in corpus.batch(step, args.batch_size, cfg.block_size, rank, world))
        lr = opt.param_groups[0]["lr"]
        t0 = time.perf_counter()
        with torch.profiler.record_function(f"train step {step + 1}"):
            loss, norm = train_step(model, opt, scaler, x, y, args)
        dt = time.perf_counter() - t0
        dist.all_reduce(loss)  # the mean over ranks: every rank logs (and the plateau sees) the same loss
        loss = loss.item() / world
        sched.step(loss) if args.schedule == "plateau" else sched.step()
        rec = {"step": step + 1, "loss": loss, "lr": lr, "grad_norm": norm,
               "tokens_per_s": args.batch_size * cfg.block_size * world / dt, "step_s": dt}
        if scaler is not None:
            rec["loss_scale"] = float(scaler.get_scale())
        records.append(rec)
        if log is not None:
            log.write(json.dumps(rec) + "\n")
            log.flush()
        bar.set_postfix(loss=f"{loss:.4f}", lr=f"{lr:.2e}", tok_s=f"{rec['tokens_per_s']:.0f}", refresh=False)
        bar.update(1)
        if prof is not None and step == max(profiled):
            _stop_profile(prof, tracer, args, rank)
            prof = tracer = None
        done = step + 1
        if args.checkpoint_dir and (done % args.checkpoint_every == 0 or done == stop):
            _save(args, done, model, opt, sched, scaler, mgr)
    bar.close()
    if log is not None:
        log.close()
    if args.checkpoint_dir and stop == args.steps:
        _save_final(args, model)
    return {"records": records, "resumed_from": start}


def model_cfg(args) -> GPTConfig:
    return MODELS[args.model]()


def _start_profile(model, args):
    from torch.profiler import ProfilerActivity, profile

    tracer = None
    if args.impl == "ours":  # our units name their waits: "minifsdp all-gather wait blocks.0", ...
        from minifsdp.pictures.tracing import Tracer

        tracer = Tracer(model).__enter__()
    cuda = getattr(args, "device", "cpu") == "cuda"
    prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU])
    prof.__enter__()
    return prof, tracer


def _stop_profile(prof, tracer, args, rank: int) -> None:
    prof.__exit__(None, None, None)
    if tracer is not None:
        tracer.__exit__(None, None, None)
    os.makedirs(args.profile, exist_ok=True)
    prof.export_chrome_trace(os.path.join(args.profile, f"rank{rank}.json"))


def run_train(args) -> int:
    """CLI entry: check every flag first (nothing started, nothing lost), then run the ranks."""
    args.job = check_args(args, MODELS, launched_by_torchrun())
    placement = resolve_device(getattr(args, "device", "cpu"), args.world_size)  # DeviceError: names the fix
    where = ("torchrun" if launched_by_torchrun() else f"{args.world_size} local ranks") + f" ({placement.describe()})"
    rank0 = not launched_by_torchrun() or os.environ.get("RANK") == "0"
    if rank0:
        resumed = f", resuming from step {args.job['resume_step']}" if args.resume else ""
        print(f"minifsdp train: TinyGPT-{args.model} on {where}, impl={args.impl}, {args.strategy}, "
              f"{args.steps} steps, {args.schedule} lr {args.lr:g} (warm-up {args.warmup}){resumed}", flush=True)
    results = spawn(train_worker, args=(args,), world_size=args.world_size, timeout_s=600,
                    backend=placement.backend)
    recs = results[0]["records"]
    if rank0 and recs:
        tps = sorted(r["tokens_per_s"] for r in recs[1:] or recs)
        print(f"done: step {recs[-1]['step']}/{args.steps}, loss {recs[-1]['loss']:.4f}, "
              f"median {tps[len(tps) // 2]:.0f} tokens/s", flush=True)
        if args.checkpoint_dir:
            what = "final weights in " + os.path.join(args.checkpoint_dir, "final") if recs[-1]["step"] == args.steps \
                else f"stopped; continue with --resume --checkpoint-dir {args.checkpoint_dir}"
            print(what, flush=True)
    return 0
