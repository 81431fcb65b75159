"""Rank function for tests/gpu: ours and torch's side by side on CUDA, one GPU per rank.

``gpu_worker(backend)`` runs the parity subset of the CPU suite with every model on
this rank's GPU and returns numpy summaries (the tests only compare them):

* FSDP FULL_SHARD / SHARD_GRAD_OP vs torch FSDP1 on the TinyGPT (losses, clip norms,
  each rank's flat shards, full parameters), ours with and without activation checkpointing;
* bf16 MixedPrecision (param_dtype=bf16, reduce_dtype=fp32) vs torch FSDP1's, FULL_SHARD;
* DDP (both bucket layouts) vs torch DDP;
* fp16 + ShardedGradScaler vs torch's, an inf on the last rank only; the flag with a rank
  that has no gradients at all (at 2+ ranks: rank 0) and one that overflows;
* the wrap-time checks whose control tensors must live on the GPU for "nccl":
  the checksum (different weights raise on every rank, at 2+ ranks), ``sync_module_states``'s
  broadcast, and a CPU module on an NCCL-only group (a clear error).

At world size 1 both FSDP1s run NO_SHARD (torch switches to it, and ours as torch): the
collectives are NCCL's one-rank all-reduces, the numbers still ours against torch's.

``backend`` is "nccl" (every tensor in a collective must be on the GPU) or
"cpu:gloo,cuda:nccl" (control tensors go through gloo, gradients through NCCL).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from minifsdp.ddp import DistributedDataParallel
from minifsdp.fsdp import FSDP, MixedPrecision, ShardedGradScaler, ShardingStrategy
from minifsdp.fsdp.activation_checkpointing import apply_activation_checkpointing
from minifsdp.models import Block, TinyGPT
from tests._workers_device import scaler_flags
from tests._workers_fsdp import batch, policy, to_numpy, torch_strategy

STEPS = 4


def _device() -> torch.device:
    """This rank's GPU (launch sets it for "nccl" only, so set it here for the mixed backend too)."""
    torch.cuda.set_device(dist.get_rank() % torch.cuda.device_count())
    torch.use_deterministic_algorithms(True, warn_only=True)  # same kernels on both sides, run to run
    return torch.device("cuda", torch.cuda.current_device())


def _batch(step: int, device: torch.device):
    x, y = batch("gpt", step, dist.get_rank(), dist.get_world_size())
    return x.to(device), y.to(device)


def _error_of(fn) -> str | None:
    try:
        fn()
    except (RuntimeError, ValueError) as e:
        return f"{type(e).__name__}: {e}"
    return None


def _summary(model, is_ours: bool, extra: dict) -> dict:
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP

    shards = [p.detach().clone() for p in model.parameters()]
    if is_ours:
        full = dict(model.state_dict())
    else:
        with TorchFSDP.summon_full_params(model):
            full = {k.replace("_fsdp_wrapped_module.", ""): v.detach().clone() for k, v in model.named_parameters()}
    return dict(shards=shards, full=full, devices=sorted({str(p.device) for p in model.parameters()}), **extra)


def _train(model, device, scaler=None, inject_inf_at=None) -> dict:
    """STEPS AdamW steps (clip 0.5), or SGD with a grad scaler (an inf on the last rank at step
    ``inject_inf_at``); losses, norms, scales, which steps happened."""
    rank, last = dist.get_rank(), dist.get_world_size() - 1
    if scaler is None:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
    out = dict(losses=[], norms=[], scales=[], stepped=[])
    for step in range(STEPS):
        x, y = _batch(step, device)
        loss = model(x, y)
        if scaler is None:
            loss.backward()
            out["norms"].append(model.clip_grad_norm_(0.5).item())
            opt.step()
        else:
            scaler.scale(loss).backward()
            if step == inject_inf_at and rank == last:
                next(iter(model.parameters())).grad[0] = float("inf")
            before = [p.detach().clone() for p in model.parameters()]
            scaler.step(opt)
            out["stepped"].append(any(not torch.equal(b, p) for b, p in zip(before, model.parameters())))
            scaler.update()
            out["scales"].append(float(scaler.get_scale()))
        opt.zero_grad()
        out["losses"].append(loss.float().item())
    return out


def _fsdp_pair(device, strategy="FULL_SHARD", mp=None):
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
    from torch.distributed.fsdp import MixedPrecision as TorchMP

    ours = FSDP(TinyGPT(seed=0), auto_wrap_policy=policy("gpt", True), sharding_strategy=ShardingStrategy[strategy],
                mixed_precision=mp, device_id=device)
    torch_mp = None if mp is None else TorchMP(param_dtype=mp.param_dtype, reduce_dtype=mp.reduce_dtype,
                                              buffer_dtype=mp.buffer_dtype)
    theirs = TorchFSDP(TinyGPT(seed=0), auto_wrap_policy=policy("gpt", False),
                       sharding_strategy=torch_strategy(ShardingStrategy[strategy]), mixed_precision=torch_mp,
                       device_id=device, use_orig_params=False)
    return ours, theirs


def fsdp_parity(device) -> dict:
    out = {}
    for strategy in ("FULL_SHARD", "SHARD_GRAD_OP"):
        ours, theirs = _fsdp_pair(device, strategy)
        out[strategy] = dict(ours=_summary(ours, True, _train(ours, device)),
                             torch=_summary(theirs, False, _train(theirs, device)))
    ours, _ = _fsdp_pair(device)
    apply_activation_checkpointing(ours, check_fn=lambda m: isinstance(m, Block))
    out["checkpointed"] = _summary(ours, True, _train(ours, device))
    return out


def mixed_precision_parity(device) -> dict:
    """bf16 compute and all-gathers, fp32 reductions and shards: ours against torch FSDP1's MixedPrecision."""
    ours, theirs = _fsdp_pair(device, mp=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    return dict(ours=_summary(ours, True, _train(ours, device)), torch=_summary(theirs, False, _train(theirs, device)))


def scaler_parity(device) -> dict:
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler as TorchScaler

    ours, theirs = _fsdp_pair(device, mp=MixedPrecision(param_dtype=torch.float16))
    mine = _train(ours, device, ShardedGradScaler(init_scale=2.0**10, growth_interval=2), inject_inf_at=1)
    other = _train(theirs, device, TorchScaler(device="cuda", init_scale=2.0**10, growth_interval=2),
                   inject_inf_at=1)
    rank, world = dist.get_rank(), dist.get_world_size()
    role = rank if world > 1 else 1  # one rank: the role of the rank that has gradients and overflows
    return dict(ours=_summary(ours, True, mine), torch=_summary(theirs, False, other),
                flags=scaler_flags(role, device))


def ddp_parity(device) -> dict:
    models = {"torch": TorchDDP(TinyGPT(seed=0).to(device), device_ids=[device.index])}
    for layout in ("reverse", "torch"):
        models[layout] = DistributedDataParallel(TinyGPT(seed=0).to(device), bucket_layout=layout)
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-2) for k, m in models.items()}
    losses = {k: [] for k in models}
    for step in range(STEPS):
        x, y = _batch(step, device)
        for k, m in models.items():
            opts[k].zero_grad()
            loss = m(x, y)
            loss.backward()
            opts[k].step()
            losses[k].append(loss.item())
    return {k: dict(losses=losses[k], params=[p.detach().clone() for p in m.module.parameters()])
            for k, m in models.items()}


def wrap_checks(device, backend: str) -> dict:
    rank = dist.get_rank()
    out = {"different_weights": _error_of(lambda: FSDP(TinyGPT(seed=rank), device_id=device))
           if dist.get_world_size() > 1 else None}  # one rank is always the same as itself
    synced = FSDP(TinyGPT(seed=rank), device_id=device, sync_module_states=True)
    out["synced_full"] = dict(synced.state_dict())
    out["rank0_full"] = dict(TinyGPT(seed=0).state_dict())
    if backend == "nccl":  # a CPU module cannot go through an NCCL-only group: say so at wrap time
        out["cpu_fsdp"] = _error_of(lambda: FSDP(TinyGPT(seed=0)))
        out["cpu_ddp"] = _error_of(lambda: DistributedDataParallel(TinyGPT(seed=0)))
    return out


def gpu_worker(backend: str) -> dict:
    device = _device()
    out = {"backend": str(dist.get_backend()), "device": str(device)}
    out["fsdp"] = fsdp_parity(device)
    out["mp_bf16"] = mixed_precision_parity(device)
    out["scaler"] = scaler_parity(device)
    out["ddp"] = ddp_parity(device)
    out["checks"] = wrap_checks(device, backend)
    return to_numpy(out)
