"""Rank function for tests/test_device_paths.py: the control collectives on 2 gloo ranks.

Returns plain Python values (devices as strings, flags as floats) for the test to compare.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from minifsdp.comm.devices import backend_devices, check_backend_supports, collective_device
from minifsdp.ddp.distributed import verify_same_shapes
from minifsdp.fsdp.checks import broadcast_from_rank0, check_same_on_all_ranks
from minifsdp.fsdp.core.strategy import ShardingPlan, ShardingStrategy, resolve_groups
from minifsdp.fsdp.grad_scaler import ShardedGradScaler


def _error_of(fn) -> str | None:
    try:
        fn()
    except (RuntimeError, ValueError) as e:
        return f"{type(e).__name__}: {e}"
    return None


def scaler_flags(rank: int, device: str | torch.device = "cpu") -> list:
    """(found_inf, its device, stepped, scale) per step: rank 0 has no gradients at all; rank 1 overflows at step 1.

    ``device``: where the parameter lives (``tests/gpu`` runs this on CUDA over NCCL).
    """
    w = nn.Parameter(torch.ones(3, device=device))
    opt = torch.optim.SGD([w], lr=0.1)
    scaler = ShardedGradScaler(init_scale=4.0, growth_interval=100)
    out = []
    for step in range(3):
        opt.zero_grad(set_to_none=True)
        if rank == 1:
            scaler.scale(w.sum()).backward()
            if step == 1:
                w.grad[0] = float("inf")
        scaler.unscale_(opt)
        found = scaler._found_inf[id(opt)]  # the all-reduced flag, read back on CPU
        before = w.detach().clone()
        scaler.step(opt)
        scaler.update()
        out.append((found.item(), str(found.device), not torch.equal(before, w), scaler.get_scale()))
    return out


def device_paths_worker() -> dict:
    rank = dist.get_rank()
    out: dict = {"backend": str(dist.get_backend()), "devices": backend_devices()}
    sub = dist.new_group([0, 1], backend="gloo")
    like = torch.zeros(2)
    out["collective_device"] = [str(collective_device()), str(collective_device(None, like)),
                                str(collective_device(sub, like))]
    out["supports_cpu"] = _error_of(lambda: check_backend_supports(None, [like], "test"))

    # FSDP's wrap-time checksum: the same weights pass, different ones fail on every rank.
    groups = resolve_groups(ShardingPlan.of(ShardingStrategy.FULL_SHARD), None)
    torch.manual_seed(0)  # the same bias on both ranks
    same = nn.Linear(4, 4)
    out["same_weights"] = _error_of(lambda: check_same_on_all_ranks(groups, same, list(same.parameters()), []))
    diff = nn.Linear(4, 4)
    nn.init.constant_(diff.weight, float(rank))  # only the weight differs
    nn.init.zeros_(diff.bias)
    out["diff_weights"] = _error_of(lambda: check_same_on_all_ranks(groups, diff, list(diff.parameters()), []))
    # sync_module_states: rank 0's numbers everywhere, then the checksums agree.
    broadcast_from_rank0(groups, list(diff.parameters()))
    out["after_broadcast"] = _error_of(lambda: check_same_on_all_ranks(groups, diff, list(diff.parameters()), []))
    out["weight_after_broadcast"] = diff.weight.detach().flatten().tolist()

    # DDP's shape signature all-gather (a control tensor of its own).
    out["shapes"] = _error_of(lambda: verify_same_shapes(nn.Linear(4, 4 + rank)))

    out["scaler"] = scaler_flags(rank)
    return out
