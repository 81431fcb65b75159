"""``python -m minifsdp.bench.zero``: DeepSpeed's ZeRO-2 and ZeRO-3 beside torch FSDP1 and ours, at 2 ranks.

Chapters 2.3 and 4.4 cite ZeRO (Rajbhandari et al. 2019); FSDP is torch's implementation of its stage 3, and
SHARD_GRAD_OP is close to its stage 2.  This bench runs DeepSpeed's own ZeRO on the book's model beside them:

    ds_zero2       deepspeed.initialize(..., zero_optimization.stage=2), fp32, its AdamW (torch_adam)
    ds_zero3       the same, stage 3
    fsdp1_full     torch FullyShardedDataParallel, FULL_SHARD, each Block its own unit     <- the reference
    fsdp1_grad_op  torch FSDP1, SHARD_GRAD_OP
    ours_full      minifsdp.FSDP, FULL_SHARD (torch.distributed's collectives)
    ours_grad_op   minifsdp.FSDP, SHARD_GRAD_OP

The same TinyGPT (``--config``, default ``bench``: 19.0M parameters), the same seed and batches, AdamW with the
same learning rate, fp32, on 2 CPU ranks over gloo.  Two phases, in one spawn:

1. **Model state per rank.**  Each trainer alone, in turn: ``gc.collect()``, a census of every live tensor
   storage (:func:`minifsdp.memory.census.live_tensor_bytes`), build the trainer, one step, ``gc.collect()``,
   the census again.  The difference is what the trainer keeps alive between steps on this rank: its
   parameters, its gradients (FSDP keeps the sharded ``.grad``; DeepSpeed whatever it keeps), its optimizer's
   state and any buffer it holds (DeepSpeed's gradient bucket).  The optimizer's state is also counted apart,
   from the state dict of the torch optimizer each one steps (DeepSpeed's inner ``engine.optimizer.optimizer``).
2. **Step time.**  All trainers built side by side and stepped in turns, ``--warmup`` rounds then ``--steps``
   (:func:`minifsdp.bench.harness.interleave`: the slowest rank's time of each call, the order rotated
   every round); medians, printed as ratios to ``fsdp1_full`` measured in the same run.

Every trainer's loss at the first step is printed too: the same model and batch, so all must agree (fp32:
within 1e-6; they reduce in other orders).

What DeepSpeed does differently, and what this bench sets.  DeepSpeed partitions each parameter group's
flattened parameters across the ranks itself (ZeRO-3: each parameter, as ``ds_tensor``), not per FSDP unit;
ZeRO-3 keeps every parameter with fewer than ``stage3_param_persistence_threshold`` elements (default 1e5)
whole on every rank; and its gradient reduction goes through a bucket of ``reduce_bucket_size`` elements
(default 5e8, a 2 GB fp32 buffer that ZeRO-3 allocates on every rank).  This bench sets
``reduce_bucket_size``, ``allgather_bucket_size`` and ``stage3_prefetch_bucket_size`` to ``--bucket-elements``
(default 6,553,600: 25 MiB of fp32, torch DDP's default bucket) and leaves the rest at DeepSpeed's defaults;
``--ds-defaults`` keeps DeepSpeed's own bucket sizes.

deepspeed is not a dependency of this project: the function that needs it imports it (a tool may import
lazily).  Install it into a venv that has this project's torch::

    DS_BUILD_OPS=0 pip install --no-build-isolation deepspeed
    python -m minifsdp.bench.zero --json chapters/results/deepspeed_zero.json
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import gc
import io
import itertools
import os
import statistics

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
from torch.distributed.fsdp import ShardingStrategy as TorchStrategy
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy as torch_policy

import minifsdp.fsdp as ours
from minifsdp.bench import harness
from minifsdp.memory.census import live_tensor_bytes
from minifsdp.models import Block, CharCorpus, GPTConfig, TinyGPT

__all__ = ["TRAINERS", "REFERENCE", "ds_config", "build", "zero_rank", "run", "main"]

TRAINERS = ("ds_zero2", "ds_zero3", "fsdp1_full", "fsdp1_grad_op", "ours_full", "ours_grad_op")
REFERENCE = "fsdp1_full"
CONFIGS = {"bench": GPTConfig.bench, "small": GPTConfig.small, "tiny": GPTConfig.tiny}
LR = 1e-4
DDP_BUCKET_ELEMENTS = 25 * 2**20 // 4  # torch DDP's default bucket_cap_mb, in fp32 elements


def ds_config(stage: int, batch_size: int, bucket_elements: int | None) -> dict:
    """DeepSpeed's config for one rank: fp32, AdamW (torch's), ZeRO ``stage``; bucket sizes set unless None."""
    zero = {"stage": stage}
    if bucket_elements is not None:
        zero.update(reduce_bucket_size=bucket_elements, allgather_bucket_size=bucket_elements)
        if stage == 3:
            zero["stage3_prefetch_bucket_size"] = bucket_elements
    return {"train_micro_batch_size_per_gpu": batch_size, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "torch_adam": True}},
            "zero_optimization": zero, "fp16": {"enabled": False}, "bf16": {"enabled": False},
            "steps_per_print": 10**9, "wall_clock_breakdown": False}


class Trainer:
    """One contender: ``step(x, y)`` returns the loss; ``optimizer`` is the torch optimizer it steps."""

    def __init__(self, step, optimizer, keep):
        self.step, self.optimizer, self.keep = step, optimizer, keep


def build(name: str, model: torch.nn.Module, batch_size: int, bucket_elements: int | None) -> Trainer:
    """``model`` as trainer ``name`` (one of :data:`TRAINERS`), on this rank."""
    if name.startswith("ds_"):
        import deepspeed  # not a dependency of the project: only this bench needs it

        for key, value in (("LOCAL_RANK", dist.get_rank()), ("RANK", dist.get_rank()),
                           ("WORLD_SIZE", dist.get_world_size())):
            os.environ.setdefault(key, str(value))  # DeepSpeed reads them; minifsdp.spawn's group is already up
        config = ds_config(int(name[-1]), batch_size, bucket_elements)
        with contextlib.redirect_stdout(io.StringIO()):  # its banner, on every rank
            engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)

        def ds_step(x, y):
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            return loss.item()
        return Trainer(ds_step, engine.optimizer.optimizer, engine)
    side, strategy = name.split("_", 1)
    strategy = {"full": "FULL_SHARD", "grad_op": "SHARD_GRAD_OP"}[strategy]
    if side == "fsdp1":
        wrapped = TorchFSDP(model, sharding_strategy=TorchStrategy[strategy], device_id=torch.device("cpu"),
                            auto_wrap_policy=functools.partial(torch_policy, transformer_layer_cls={Block}))
    else:
        wrapped = ours.FullyShardedDataParallel(model, sharding_strategy=ours.ShardingStrategy[strategy],
                                auto_wrap_policy=functools.partial(ours.transformer_auto_wrap_policy,
                                                                   transformer_layer_cls={Block}))
    optimizer = torch.optim.AdamW(wrapped.parameters(), lr=LR)

    def fsdp_step(x, y):
        optimizer.zero_grad(set_to_none=True)
        loss = wrapped(x, y)
        loss.backward()
        optimizer.step()
        return loss.item()
    return Trainer(fsdp_step, optimizer, wrapped)


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """The bytes of every tensor in ``optimizer.state`` (AdamW: exp_avg, exp_avg_sq, step), each storage once."""
    seen = {}
    for state in optimizer.state.values():
        for value in state.values():
            if torch.is_tensor(value):
                seen[value.untyped_storage().data_ptr()] = value.untyped_storage().nbytes()
    return sum(seen.values())


def zero_rank(names: list[str], config: str, batch_size: int, warmup: int, steps: int,
              bucket_elements: int | None) -> dict:
    """One rank: each trainer's model state alone (a census before and after one step), then all in turns."""
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg, corpus = CONFIGS[config](), CharCorpus()
    model = TinyGPT(cfg, seed=0)
    batches = [corpus.batch(i, batch_size, cfg.block_size, rank, world) for i in range(warmup + steps)]
    say = harness.say_on_rank0(f"N={world}")
    state, losses = {}, {}
    for name in names:  # phase 1: alone, so the census sees one trainer
        gc.collect()
        before = live_tensor_bytes()
        trainer = build(name, copy.deepcopy(model), batch_size, bucket_elements)
        losses[name] = trainer.step(*batches[0])
        gc.collect()
        state[name] = {"model_state_bytes": live_tensor_bytes() - before,
                       "optimizer_state_bytes": optimizer_state_bytes(trainer.optimizer)}
        del trainer
        say(f"{name}: {state[name]['model_state_bytes'] / 2**20:.2f} MiB alive after a step")
    trainers = {name: build(name, copy.deepcopy(model), batch_size, bucket_elements) for name in names}

    def one_step(trainer):
        feed = itertools.cycle(batches)
        return lambda: trainer.step(*next(feed))
    say(f"built {', '.join(names)} side by side; {warmup} warm-up round(s), then {steps}")
    timings = harness.interleave({n: one_step(t) for n, t in trainers.items()}, steps, warmup, say=say)
    return {"state": state, "first_loss": losses, "times": timings.wall, "cpu": timings.cpu,
            "parameters": sum(p.numel() for p in model.parameters())}


def run(names: list[str], config: str = "bench", batch_size: int = 2, warmup: int = 2, steps: int = 8,
        bucket_elements: int | None = DDP_BUCKET_ELEMENTS, world_size: int = 2) -> dict:
    """The bench on ``world_size`` ranks (one intra-op thread each); returns the rows and the run's facts."""
    import deepspeed  # checked here, before ranks start: a clear error without it

    load_before = harness.load_average()
    per_rank = harness.run_ranks(zero_rank, (names, config, batch_size, warmup, steps, bucket_elements),
                                 world_size)
    rows = []
    for name in names:
        step_s = statistics.median(per_rank[0]["times"][name])
        rows.append({"trainer": name, "world_size": world_size,
                     "model_state_bytes": [r["state"][name]["model_state_bytes"] for r in per_rank],
                     "optimizer_state_bytes": [r["state"][name]["optimizer_state_bytes"] for r in per_rank],
                     "first_loss": [r["first_loss"][name] for r in per_rank],
                     "step_s": step_s, "step_times_s": per_rank[0]["times"][name],
                     "cpu_s": statistics.median(per_rank[0]["cpu"][name])})
    reference = next((r for r in rows if r["trainer"] == REFERENCE), None)
    for r in rows:
        if reference is not None:
            r["step_x_fsdp1_full"] = r["step_s"] / reference["step_s"]
            r["state_x_fsdp1_full"] = max(r["model_state_bytes"]) / max(reference["model_state_bytes"])
    return {"rows": rows, "config": config, "parameters": per_rank[0]["parameters"], "batch_size": batch_size,
            "warmup": warmup, "steps": steps, "deepspeed": deepspeed.__version__,
            "bucket_elements": bucket_elements, "load_average_before": load_before,
            "ds_config_zero3": ds_config(3, batch_size, bucket_elements)}


def format_table(result: dict) -> str:
    """One line per trainer: model state per rank (MiB, and x fsdp1_full), optimizer state, step time ratio."""
    ranks = len(result["rows"][0]["first_loss"])
    lines = [f"TinyGPT {result['config']} ({result['parameters']:,} parameters), {ranks} ranks, fp32 AdamW; "
             f"deepspeed {result['deepspeed']}, bucket elements {result['bucket_elements']}",
             f"{'trainer':15s} {'model state MiB/rank':>21s} {'x fsdp1_full':>13s} {'Adam state MiB':>15s} "
             f"{'step ms':>8s} {'x fsdp1_full':>13s} {'first loss':>11s}"]
    for r in result["rows"]:
        lines.append(f"{r['trainer']:15s} {max(r['model_state_bytes']) / 2**20:21.2f}"
                     f" {r.get('state_x_fsdp1_full', 0):13.3f} {max(r['optimizer_state_bytes']) / 2**20:15.2f}"
                     f" {r['step_s'] * 1e3:8.1f}"
                     f" {r.get('step_x_fsdp1_full', 0):13.2f} {r['first_loss'][0]:11.6f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m minifsdp.bench.zero", description=__doc__.split("\n")[0])
    parser.add_argument("--trainers", default=",".join(TRAINERS), help="a comma-separated subset of the trainers")
    parser.add_argument("--config", default="bench", choices=sorted(CONFIGS))
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--bucket-elements", type=int, default=DDP_BUCKET_ELEMENTS)
    parser.add_argument("--ds-defaults", action="store_true", help="keep DeepSpeed's own bucket sizes")
    parser.add_argument("--json", default="", help="where to write the rows (none if empty)")
    args = parser.parse_args(argv)
    names = harness.choose(args.trainers, TRAINERS, "--trainers")
    result = run(names, args.config, args.batch_size, args.warmup, args.steps,
                 None if args.ds_defaults else args.bucket_elements)
    print(format_table(result), flush=True)
    if args.json:
        harness.save_rows(args.json, result.pop("rows"), **result)
    return result


if __name__ == "__main__":  # run from the module's own name, so that the ranks can import zero_rank by reference
    from minifsdp.bench.zero import main as bench_main

    bench_main()
