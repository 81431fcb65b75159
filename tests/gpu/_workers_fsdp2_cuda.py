"""Rank function for tests/gpu/test_fsdp2_cuda.py: our ``fully_shard`` beside torch's FSDP2 on this rank's GPU.

Each rank builds the TinyGPT twice from one seed on its GPU, shards one copy with ours and one with
torch's ``torch.distributed.fsdp.fully_shard`` (each Block, then the root, over
``init_device_mesh("cuda", (N,))``), trains both on the same batches with AdamW, and returns the
losses, every parameter's local rows (``to_local()``) and full tensors (``full_tensor()``), in fp32
and under ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``.

AdamW gets ``foreach=False`` on both sides: by default it picks its multi-tensor kernels from the
parameters' Python type (torch's DTensor qualifies), which is the optimizer's choice, not
fully_shard's; with the same loop on both sides the comparison is about sharding alone.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP
from torch.distributed.fsdp import fully_shard as torch_fully_shard

from minifsdp.fsdp2 import MixedPrecisionPolicy, fully_shard
from minifsdp.models import TinyGPT
from tests._workers_fsdp import to_numpy
from tests.gpu._workers_gpu import STEPS, _batch, _device


def _shard(model, impl: str, precision: str, mesh):
    bf16 = dict(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if precision == "bf16" else {}
    if impl == "ours":
        shard, policy = fully_shard, MixedPrecisionPolicy(**bf16)
    else:
        shard, policy = torch_fully_shard, TorchMP(**bf16)
    for block in model.blocks:
        shard(block, mesh=mesh, mp_policy=policy)
    return shard(model, mesh=mesh, mp_policy=policy)


def _train(model, device) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    losses = []
    for step in range(STEPS):
        x, y = _batch(step, device)
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.float().item())
    return losses


def fsdp2_worker() -> dict:
    device = _device()
    mesh = init_device_mesh("cuda", (dist.get_world_size(),))
    out = {"device": str(device)}
    for precision in ("fp32", "bf16"):
        for impl in ("torch", "ours"):
            model = _shard(TinyGPT(seed=0).to(device), impl, precision, mesh)
            losses = _train(model, device)
            out[f"{impl}/{precision}"] = {
                "losses": losses,
                "locals": {n: p.to_local().detach().clone() for n, p in model.named_parameters()},
                "full": {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()},
                "devices": sorted({str(p.to_local().device) for p in model.parameters()}),
            }
    return to_numpy(out)
