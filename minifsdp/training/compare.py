"""The main job: ``python -m minifsdp compare`` trains the tiny GPT with ours and torch's, side by side.

``--strategy`` picks the pair (``ours`` is always minifsdp, ``torch`` the reference):

    --strategy FULL_SHARD | SHARD_GRAD_OP | NO_SHARD | HYBRID_SHARD   (default FULL_SHARD)
        ours  = minifsdp.FullyShardedDataParallel   torch = torch FSDP1 (use_orig_params=False)
        both wrap every transformer Block as its own unit; HYBRID_SHARD shards inside pairs of
        consecutive ranks and replicates across pairs (4 ranks = 2 x 2)
    --strategy ddp
        ours  = minifsdp.DistributedDataParallel    torch = torch.nn.parallel.DistributedDataParallel

``--impl fsdp2`` swaps the FSDP pair for the per-parameter one (chapter 5):

    --impl fsdp2 [--strategy FULL_SHARD | SHARD_GRAD_OP | HYBRID_SHARD]
        ours  = minifsdp.fully_shard                torch = torch.distributed.fsdp.fully_shard
        both called on every Block, then on the root, over the same ``DeviceMesh``; FULL_SHARD is
        ``reshard_after_forward`` left at its default (True but for the root), SHARD_GRAD_OP is False,
        HYBRID_SHARD is a 2-D mesh ``(replicate, shard)`` with pairs of ranks sharding

Every rank builds each trainer's model from the same seed and feeds it the same
``CharCorpus`` batch at every step, so any difference is the trainers' doing:

    rank r, step s:  batch(s, r) ──> ours  ──> loss, params (FSDP: this rank's flat shards)
                                └──> torch ──> loss, params
                     compare: |loss difference|, max |param difference| (every rank)

Under FSDP the parameters compared are each rank's local flat shards, unit by
unit: ours and torch FSDP1 lay them out identically (``fsdp/core/flat_param.py``), so the
shards of all ranks together cover every parameter, each exactly once.  Under
``--impl fsdp2`` they are each parameter's local rows (``to_local()`` of ours and of
torch's DTensor), matched by name.

The trainers run interleaved in the same processes, in the same minute, so the
ratio of their step times is a fair comparison (absolute times depend on the
machine and mean little).

``--device cuda`` (``minifsdp/training/devices.py``): rank r on GPU r over NCCL, every model moved
there before it is wrapped, torch FSDP1 given ``device_id`` = that GPU, the meshes on "cuda", the
collectives NCCL's (``--collectives torch``, the default there: our ring is written for gloo's
CPU tensors), and deterministic kernels (cuBLAS's workspace setting and
``torch.use_deterministic_algorithms``), so the two sides run the same kernels and the verdict
can be bitwise.  Each timed step ends with ``torch.cuda.synchronize()``.

Note (why bitwise): our DDP scales gradients by 1/N and all-reduces them with
SUM in buckets laid out as torch's (``bucket_layout="torch"``), exactly as
torch's Reducer does; our FSDP divides before and after the reduce-scatter by
torch FSDP1's factors (``fsdp/core/strategy.py``).  At 2 ranks the sum a + b has only one
possible rounding, so even our ring gives the same bits; at 3+ ranks our ring
may add in another order than gloo's and differ in the last bits (the verdict
then says "within tol").
"""

from __future__ import annotations

import copy
import functools
import statistics
import time
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from minifsdp.launch import spawn
from minifsdp.models import CharCorpus, GPTConfig, TinyGPT
from minifsdp.training.devices import DeviceError, deterministic_cuda, rank_device, resolve_device, synchronize

__all__ = ["run_compare", "TRAINERS", "STRATEGIES", "IMPLS", "compare_worker"]

BATCH_PER_RANK = 8
TOL = 1e-4  # "within tol": AdamW can amplify a last-bit gradient difference to ~1e-5 in a few steps


def _ours_ddp(model: nn.Module, args) -> nn.Module:
    from minifsdp.ddp.distributed import DistributedDataParallel

    return DistributedDataParallel(model, collectives=args.collectives, bucket_layout="torch")


def _torch_ddp(model: nn.Module, args) -> nn.Module:
    index = next(model.parameters()).device.index
    return torch.nn.parallel.DistributedDataParallel(model, device_ids=None if index is None else [index])


def _ours_fsdp(model: nn.Module, args) -> nn.Module:
    from minifsdp.fsdp.core.wrap import transformer_auto_wrap_policy
    from minifsdp.fsdp.fully_sharded import FullyShardedDataParallel
    from minifsdp.models import Block

    return FullyShardedDataParallel(
        model, process_group=args.process_group, sharding_strategy=args.strategy, collectives=args.collectives,
        auto_wrap_policy=functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block}))


def _torch_fsdp1(model: nn.Module, args) -> nn.Module:
    from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

    from minifsdp.models import Block

    return FullyShardedDataParallel(
        model, process_group=args.process_group, sharding_strategy=ShardingStrategy[args.strategy],
        auto_wrap_policy=functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block}),
        device_id=_device_of(args), use_orig_params=False)  # FSDP1 on CPU must be told its device


def _device_of(args) -> torch.device:
    """The rank's device (``compare_worker`` sets it from ``--device``; CPU for a caller that did not)."""
    return getattr(args, "torch_device", torch.device("cpu"))


def _fsdp2_mesh(args):
    """The mesh both FSDP2 trainers shard over: 1-D over the world, or ``(replicate, shard)`` for HYBRID_SHARD."""
    from torch.distributed.device_mesh import init_device_mesh

    world, kind = dist.get_world_size(), _device_of(args).type
    if args.strategy == "HYBRID_SHARD":
        return init_device_mesh(kind, (world // 2, 2), mesh_dim_names=("replicate", "shard"))
    return init_device_mesh(kind, (world,))


def _fsdp2_apply(shard, model: nn.Module, args, **extra) -> nn.Module:
    """``shard`` (ours or torch's ``fully_shard``) on every Block, then on the root, as both libraries teach."""
    kw = {"mesh": args.mesh, "reshard_after_forward": False if args.strategy == "SHARD_GRAD_OP" else None, **extra}
    for block in model.blocks:
        shard(block, **kw)
    return shard(model, **kw)


def _ours_fsdp2(model: nn.Module, args) -> nn.Module:
    from minifsdp.fsdp2 import fully_shard

    return _fsdp2_apply(fully_shard, model, args, collectives=args.collectives)


def _torch_fsdp2(model: nn.Module, args) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    return _fsdp2_apply(fully_shard, model, args)


# family -> trainers, name -> wrap(model, args); the first is under test, the last is the reference.
TRAINERS: dict[str, dict[str, Callable[[nn.Module, object], nn.Module]]] = {
    "ddp": {"ours": _ours_ddp, "torch": _torch_ddp},
    "fsdp": {"ours": _ours_fsdp, "torch": _torch_fsdp1},
    "fsdp2": {"ours": _ours_fsdp2, "torch": _torch_fsdp2},
}
STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "ddp")
IMPLS = ("fsdp1", "fsdp2")
FSDP2_STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD")  # FSDP2 has no NO_SHARD; ddp is not FSDP
DESCRIPTION = {"ddp": "minifsdp DDP vs torch DDP"} | {
    s: f"minifsdp FSDP vs torch FSDP1, {s}, each Block a unit" for s in STRATEGIES if s != "ddp"} | {
    f"fsdp2/{s}": f"minifsdp fully_shard vs torch fully_shard (FSDP2), {s}, each Block then the root"
    for s in FSDP2_STRATEGIES}


def _family(strategy: str, impl: str = "fsdp1") -> str:
    if strategy == "ddp":
        return "ddp"
    return "fsdp2" if impl == "fsdp2" else "fsdp"


def _optimizer(params, kind: str):
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.1)
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=3e-3)
    raise ValueError(f"optimizer must be 'sgd' or 'adamw', got {kind!r}")


def _local(p: torch.Tensor) -> torch.Tensor:
    """The rows this rank holds: ``to_local()`` of an FSDP2 parameter (ours or a DTensor), else ``p`` itself."""
    return (p.to_local() if hasattr(p, "to_local") else p).detach()


def _max_param_diff(a: nn.Module, b: nn.Module) -> float:
    """Max |a - b| over the parameters the wrappers hold on this rank (FSDP: the local flat shards;
    FSDP2: each parameter's local rows, which must come under the same names)."""
    na, nb = [n for n, _ in a.named_parameters()], [n for n, _ in b.named_parameters()]
    if hasattr(next(a.parameters()), "to_local") and na != nb:
        raise RuntimeError(f"the two trainers name their parameters differently: {na} vs {nb}")
    pa, pb = [_local(p) for p in a.parameters()], [_local(p) for p in b.parameters()]
    if len(pa) != len(pb):
        raise RuntimeError(f"the two trainers hold {len(pa)} and {len(pb)} parameters on this rank")
    if [p.shape for p in pa] != [q.shape for q in pb]:
        raise RuntimeError(f"the two trainers hold differently shaped parameters on this rank: "
                           f"{[tuple(p.shape) for p in pa]} vs {[tuple(q.shape) for q in pb]}")
    return max(((p - q).abs().max().item() for p, q in zip(pa, pb) if p.numel()), default=0.0)


def compare_worker(args, trainer_names: list[str]) -> dict:
    """One rank: train every trainer for ``args.steps``; rank 0 prints a row per step as it goes."""
    rank, world = dist.get_rank(), dist.get_world_size()
    corpus = CharCorpus()
    cfg = GPTConfig.tiny()
    args = copy.copy(args)
    args.process_group = None
    args.torch_device = device = rank_device(getattr(args, "device", "cpu"))
    if device.type == "cuda":
        torch.use_deterministic_algorithms(True, warn_only=True)  # the same kernels on both sides
    family = _family(args.strategy, getattr(args, "impl", "fsdp1"))
    if family == "fsdp" and args.strategy == "HYBRID_SHARD":  # shard inside pairs of ranks, replicate across
        from minifsdp.fsdp.torch_options import hybrid_groups

        args.process_group = hybrid_groups(2)
    if family == "fsdp2":
        args.mesh = _fsdp2_mesh(args)
    trainers = TRAINERS[family]
    models = {name: trainers[name](TinyGPT(cfg, seed=0).to(device), args) for name in trainer_names}
    opts = {name: _optimizer(m.parameters(), args.optimizer) for name, m in models.items()}
    first, ref = trainer_names[0], trainer_names[-1]
    losses = {name: [] for name in trainer_names}
    times = {name: [] for name in trainer_names}
    diffs = []
    if rank == 0:
        print(f"{'step':>4}  " + "  ".join(f"{n + ' loss':>12}" for n in trainer_names) + "  max|param diff|",
              flush=True)
    for step in range(args.steps):
        x, y = (t.to(device) for t in corpus.batch(step, BATCH_PER_RANK, cfg.block_size, rank, world))
        order = trainer_names if step % 2 == 0 else trainer_names[::-1]  # neither always goes first
        for name in order:
            model, opt = models[name], opts[name]
            synchronize(device)
            t0 = time.perf_counter()
            opt.zero_grad()
            loss = model(x, y)
            loss.backward()
            opt.step()
            synchronize(device)
            times[name].append(time.perf_counter() - t0)
            global_loss = loss.detach().clone()  # outside the timed region: the mean over ranks
            dist.all_reduce(global_loss)
            losses[name].append(global_loss.item() / world)
        diffs.append(_max_param_diff(models[first], models[ref]))
        if rank == 0:
            print(f"{step:>4}  " + "  ".join(f"{losses[n][-1]:>12.6f}" for n in trainer_names) + f"  {diffs[-1]:.3g}",
                  flush=True)
    return {"losses": losses, "times": times, "diffs": diffs}


def run_compare(args) -> int:
    """CLI entry: spawn ``args.world_size`` ranks, print the table and verdict, save the loss-curve PNG."""
    if args.steps < 1:
        raise SystemExit(f"--steps must be at least 1, got {args.steps}")
    strategy = getattr(args, "strategy", "FULL_SHARD")
    if strategy not in STRATEGIES:
        raise SystemExit(f"--strategy must be one of {', '.join(STRATEGIES)}, got {strategy!r}")
    impl = getattr(args, "impl", "fsdp1")
    if impl not in IMPLS:
        raise SystemExit(f"--impl must be one of {', '.join(IMPLS)}, got {impl!r}")
    if impl == "fsdp2" and strategy not in FSDP2_STRATEGIES:
        raise SystemExit(f"--impl fsdp2 pairs our fully_shard with torch's; --strategy must be one of "
                         f"{', '.join(FSDP2_STRATEGIES)} with it, got {strategy!r}")
    if strategy == "HYBRID_SHARD" and (args.world_size < 4 or args.world_size % 2):
        raise SystemExit(f"--strategy HYBRID_SHARD shards inside pairs of ranks and replicates across pairs: "
                         f"it needs an even world size of at least 4, got {args.world_size}; try --world-size 4")
    device = getattr(args, "device", "cpu")
    placement = resolve_device(device, args.world_size)
    collectives = getattr(args, "collectives", None) or ("ring" if device == "cpu" else "torch")
    if device == "cuda" and collectives == "ring":
        raise DeviceError("--collectives ring is our ring on gloo's CPU tensors; with --device cuda the "
                          "collectives are NCCL's: use --collectives torch (the default there), or --device cpu.")
    args.strategy, args.impl, args.collectives, args.device = strategy, impl, collectives, device
    if device == "cuda":
        deterministic_cuda()  # before any rank starts CUDA
    family = _family(strategy, impl)
    names = list(TRAINERS[family])
    description = DESCRIPTION[f"fsdp2/{strategy}" if family == "fsdp2" else strategy]
    print(f"minifsdp compare: TinyGPT on {args.world_size} local ranks ({placement.describe()}), {args.steps} steps, "
          f"{args.optimizer}, our collectives={args.collectives}; {description}; "
          f"trainers: {', '.join(names)}", flush=True)
    results = spawn(compare_worker, args=(args, names), world_size=args.world_size, backend=placement.backend,
                    timeout_s=120 if device == "cpu" else 300)
    res = results[0]
    worst = max(r["diffs"][-1] for r in results)
    first, ref = names[0], names[-1]
    if all(d == 0.0 for r in results for d in r["diffs"]):
        verdict = f"VERDICT: bitwise equal over {args.steps} steps ({first} vs {ref}, every rank)"
    elif worst <= TOL:
        verdict = f"VERDICT: within tol {TOL:g} over {args.steps} steps (max |param diff| {worst:.3g})"
    else:
        verdict = f"VERDICT: MISMATCH, max |param diff| {worst:.3g} > tol {TOL:g}"
    print(verdict)

    # Skip the first step of each (warm-up: allocations, bucket rebuild) when there are enough steps.
    med = {n: statistics.median(res["times"][n][1:] if args.steps > 2 else res["times"][n]) for n in names}
    print("median step time (rank 0): " + ", ".join(f"{n} {med[n] * 1e3:.1f} ms" for n in names)
          + f"; ratio {first}/{ref} = {med[first] / med[ref]:.2f}")

    import matplotlib

    matplotlib.use("Agg")
    from minifsdp.pictures.plots import plot_losses

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    label = f"{strategy}, FSDP2" if family == "fsdp2" else strategy
    fig = plot_losses(res["losses"], title=f"TinyGPT, {args.world_size} ranks, {label}: {first} vs {ref}")
    fig.savefig(out / "compare_losses.png", dpi=100)
    print(f"saved {out / 'compare_losses.png'}")
    return 0 if not verdict.startswith("VERDICT: MISMATCH") else 1
