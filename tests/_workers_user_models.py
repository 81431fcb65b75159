"""Rank functions for tests/test_fsdp_user_models.py: models this project's own fixtures never built.

Each runs ours and torch FSDP1 (``use_orig_params`` as asked, ``device_id=cpu``) on the same
seed and data and returns what a user would look at: losses, buffers, names and tensors inside
``summon_full_params``, each rank's local shards.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from minifsdp.fsdp import FSDP
from minifsdp.fsdp.torch_options import size_based_auto_wrap_policy

STEPS = 3


def bn_model(seed: int = 0) -> nn.Module:
    """Linear -> BatchNorm1d -> ReLU -> Linear, sizes no world size up to 4 divides (BatchNorm has a 0-dim buffer)."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 7), nn.BatchNorm1d(7), nn.ReLU(), nn.Linear(7, 3))


def mlp_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 13), nn.ReLU(), nn.Linear(13, 11), nn.ReLU(), nn.Linear(11, 3))


def _batch(step: int, rank: int, rows: int = 4):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(rows, 5, generator=g), torch.randn(rows, 3, generator=g)


def _policy(ours: bool):
    if ours:
        return functools.partial(size_based_auto_wrap_policy, min_num_params=40)
    from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy as torch_policy

    return functools.partial(torch_policy, min_num_params=40)


def _wrap(ours: bool, model: nn.Module, use_orig_params: bool):
    if ours:
        return FSDP(model, auto_wrap_policy=_policy(True), use_orig_params=use_orig_params)
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP

    return TorchFSDP(model, auto_wrap_policy=_policy(False), use_orig_params=use_orig_params,
                     device_id=torch.device("cpu"))


def _full_named(model) -> list[tuple[str, tuple, torch.Tensor]]:
    """Inside summon_full_params, exactly as torch users read it: named_parameters() of the wrapped model."""
    cls = type(model)
    with cls.summon_full_params(model):
        return [(n, tuple(p.shape), p.detach().clone()) for n, p in model.named_parameters()]


def batchnorm_worker(use_orig_params: bool) -> dict:
    """Train the BatchNorm model 3 SGD steps; losses, buffers, full parameters, shards for both."""
    rank = dist.get_rank()
    out = {}
    for side in ("ours", "torch"):
        model = _wrap(side == "ours", bn_model(), use_orig_params)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        losses = []
        for step in range(STEPS):
            x, y = _batch(step, rank)
            loss = F.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        model.eval()
        with torch.no_grad():
            eval_out = model(_batch(99, rank)[0])
        buffers = {n.replace("_fsdp_wrapped_module.", ""): b.clone() for n, b in model.named_buffers()}
        out[side] = dict(losses=losses, eval=eval_out, buffers=buffers, full=_full_named(model),
                         shards=[p.detach().clone() for p in model.parameters()])
    return out


def summon_worker(use_orig_params: bool) -> dict:
    """What code written for torch sees inside summon_full_params: names, shapes, values, a flattened copy."""
    out = {}
    for side in ("ours", "torch"):
        model = _wrap(side == "ours", mlp_model(), use_orig_params)
        full = _full_named(model)
        with type(model).summon_full_params(model):
            flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()
            with torch.no_grad():  # an edit inside, written back to the shards on exit
                next(iter(model.parameters())).add_(1.0)
        after = _full_named(model)
        out[side] = dict(full=full, flat=flat, after=after)
    return out


def no_sync_worker(use_orig_params: bool, set_to_none: bool = True, discard: bool = True) -> dict:
    """A no_sync micro-batch, then a synced one, then the step, 3 times.

    ``discard=True``: the user throws the no_sync gradients away with ``zero_grad(set_to_none)``
    before the synced micro-batch; ``discard=False``: the ordinary use, they accumulate.
    """
    rank = dist.get_rank()
    out = {}
    for side in ("ours", "torch"):
        model = _wrap(side == "ours", mlp_model(), use_orig_params)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        losses = []
        for step in range(STEPS):
            with model.no_sync():
                x, y = _batch(100 + step, rank)
                F.mse_loss(model(x), y).backward()
            if discard:
                opt.zero_grad(set_to_none=set_to_none)
            x, y = _batch(step, rank)
            loss = F.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=set_to_none)
            losses.append(loss.item())
        out[side] = dict(losses=losses, full=_full_named(model))
    return out


def mixed_dtype_worker() -> dict:
    """One unit whose parameters mix float32 and bfloat16: both refuse; what each says."""
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP

    out = {}
    for side, wrap in (("ours", FSDP), ("torch", functools.partial(TorchFSDP, device_id=torch.device("cpu")))):
        model = mlp_model()
        model[2].to(torch.bfloat16)
        try:
            wrap(model)
            out[side] = None
        except Exception as e:  # noqa: BLE001 - the message is the result
            out[side] = f"{type(e).__name__}: {e}"
    return out


def recurse_false_worker() -> dict:
    """summon_full_params(root, recurse=False) on a root that owns no parameter of its own."""
    torch.manual_seed(0)
    model = FSDP(nn.Sequential(nn.Linear(5, 13), nn.Linear(13, 3)),
                 auto_wrap_policy=functools.partial(size_based_auto_wrap_policy, min_num_params=1))
    with FSDP.summon_full_params(model, recurse=False):
        inside = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    return dict(root_has_params=model._handle is not None, inside=inside)
