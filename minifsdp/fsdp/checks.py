"""Wrap-time and step-time checks: bad input becomes a clear error, never a hang or a silent mistake.

* every own parameter and buffer on one device (one flat parameter lives on one device);
* the same weights on every rank (a checksum per tensor, one MIN and one MAX all-reduce),
  or ``sync_module_states=True`` to broadcast rank 0's;
* an optimizer built before wrapping: a process-wide optimizer step pre-hook refuses
  parameters that FSDP flattened away (they no longer train);
* a module on a device the group's backend cannot send (CPU on a plain "nccl" group).

Note (control tensors): the checksums are ours, not the module's, so they are made on
``collective_device(group, like=a module tensor)``: CPU on gloo or "cpu:gloo,cuda:nccl",
the module's GPU on a plain "nccl" group (which moves CUDA tensors only).  The result
comes back to CPU for the comparison in Python.  The helpers live in
``minifsdp.ddp.distributed`` (DDP needs them first); they are re-exported here.
"""

from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from minifsdp.ddp.distributed import backend_devices, check_backend_supports, collective_device

__all__ = ["check_one_device", "check_same_on_all_ranks", "broadcast_from_rank0", "install_optimizer_check",
           "backend_devices", "check_backend_supports", "collective_device"]


def check_same_on_all_ranks(groups, module, params, buffers) -> None:
    """Compare a checksum of every own parameter and buffer across ranks (a MIN and a MAX all-reduce)."""
    tensors = params + buffers
    if not tensors:
        return
    digests = torch.tensor([_digest(t) for t in tensors], dtype=torch.int64)
    for group in filter(None, (groups.shard, groups.replicate)):
        check_backend_supports(group, tensors, "FSDP")
        device = collective_device(group, like=tensors[0])
        lo, hi = digests.to(device, copy=True), digests.to(device, copy=True)
        dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=group)
        dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=group)
        bad = (lo.cpu() != hi.cpu()).nonzero().flatten().tolist()
        if bad:
            names = {id(t): n for n, t in list(module.named_parameters()) + list(module.named_buffers())}
            which = ", ".join(names.get(id(tensors[i]), "?") for i in bad[:5])
            raise RuntimeError(
                f"FSDP: the model differs across ranks at wrap time ({which}). Every rank must start from the "
                "same weights: build the model with the same seed on every rank, or pass "
                "sync_module_states=True to copy rank 0's parameters and buffers to all ranks."
            )


def broadcast_from_rank0(groups, tensors) -> None:
    """sync_module_states=True: every rank takes rank 0's parameters and buffers (replicate, then shard group)."""
    for group in filter(None, (groups.replicate, groups.shard)):
        check_backend_supports(group, tensors, "FSDP(sync_module_states=True)")
        src = dist.get_global_rank(group, 0)
        for t in tensors:
            with torch.no_grad():
                dist.broadcast(t.data, src=src, group=group)


def check_one_device(module: nn.Module, params, buffers) -> None:
    """One flat parameter lives on one device: refuse a module whose own tensors are spread over several."""
    devices = {}
    names = {id(t): n for n, t in list(module.named_parameters()) + list(module.named_buffers())}
    for t in params + buffers:
        devices.setdefault(t.device, names.get(id(t), "?"))
    if len(devices) > 1:
        where = ", ".join(f"{n} on {d}" for d, n in devices.items())
        raise ValueError(f"FSDP: the module's parameters/buffers sit on different devices ({where}); one flat "
                         "parameter lives on one device. Move the module first: module.to(device), or pass device_id=.")


def _digest(t: torch.Tensor) -> int:
    """A 56-bit checksum of the tensor's bytes; works for 0-dim tensors (BatchNorm's num_batches_tracked) too."""
    data = t.detach().cpu().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()
    return int.from_bytes(hashlib.blake2b(data, digest_size=7).digest(), "little")


_OPTIMIZER_CHECK = []


def install_optimizer_check() -> None:
    """Once per process: before any optimizer step, refuse parameters that FSDP has replaced."""
    if _OPTIMIZER_CHECK:
        return

    def check(optimizer, args, kwargs):
        for group in optimizer.param_groups:
            for p in group["params"]:
                if hasattr(p, "_minifsdp_orphan"):
                    raise RuntimeError(
                        f"{type(optimizer).__name__} holds the parameter '{p._minifsdp_orphan}' that FSDP has "
                        "flattened away: the optimizer was built before wrapping, so it would train nothing. "
                        "Build it after wrapping: torch.optim.X(fsdp_model.parameters(), ...)."
                    )

    _OPTIMIZER_CHECK.append(register_optimizer_step_pre_hook(check))
