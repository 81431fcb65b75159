"""Rank functions for the mixed-precision regimes: gradient accumulation under NO_SHARD, fp16 averaging at 4 ranks.

Each worker builds ours and torch FSDP1 side by side (``_workers_fsdp.fsdp_pair``: the MLP, nested
wrapping, the same seed and data), runs the same steps on both, and returns what the test compares
bitwise: every gradient the optimizer would read after each backward (its dtype and its numbers), the
parameters after each optimizer step, the losses.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

import minifsdp
from tests._workers_fsdp import batch, fsdp_pair, loss_of, to_numpy

BF16 = minifsdp.MixedPrecision(param_dtype=torch.bfloat16)  # reduce_dtype unset: reduced in bf16, as torch
FP16 = minifsdp.MixedPrecision(param_dtype=torch.float16, reduce_dtype=torch.float16)


def _name(n: str) -> str:
    return n.replace("_fsdp_wrapped_module.", "")


def grads(model) -> dict:
    """``{name: (dtype, numbers)}`` of each parameter's ``.grad`` (``(None, None)`` if it has none).

    ``use_orig_params=False``: the flat parameters (NO_SHARD: the whole flat gradient);
    ``use_orig_params=True``: every original parameter.  Numbers travel as fp32 (an exact widening
    of bf16 and fp16; numpy has no bf16), the dtype beside them."""
    out = {}
    for n, p in model.named_parameters():
        g = p.grad
        out[_name(n)] = (None, None) if g is None else (str(g.dtype), g.detach().float().clone())
    return out


def params(model) -> dict:
    return {_name(n): (str(p.dtype), p.detach().float().clone()) for n, p in model.named_parameters()}


def _sgd(model):
    # SGD with momentum, not Adam: Adam's scale invariance would hide a gradient off by a factor.
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def accumulate_in_no_sync(model, steps: int = 2) -> dict:
    """Each step: the first half of the batch backward inside ``no_sync()``, the second half synced, step."""
    rank, world = dist.get_rank(), dist.get_world_size()
    opt, rec = _sgd(model), {"grads": [], "params": [], "losses": []}
    for step in range(steps):
        x, y = batch("mlp", step, rank, world)
        for part, ctx in ((slice(0, 2), model.no_sync()), (slice(2, None), contextlib.nullcontext())):
            with ctx:
                loss = loss_of("mlp", model, x[part], y[part])
                loss.backward()
            rec["losses"].append(loss.item())
            rec["grads"].append(grads(model))
        opt.step()
        rec["params"].append(params(model))
        opt.zero_grad()
    return rec


def accumulate_without_zero_grad(model, steps: int = 3) -> dict:
    """Synced backwards, an optimizer step after each, and no ``zero_grad`` at all: each new gradient adds
    onto the (fp32, reduced) one the last step used."""
    rank, world = dist.get_rank(), dist.get_world_size()
    opt, rec = _sgd(model), {"grads": [], "params": [], "losses": []}
    for step in range(steps):
        x, y = batch("mlp", step, rank, world)
        loss = loss_of("mlp", model, x, y)
        loss.backward()
        rec["losses"].append(loss.item())
        rec["grads"].append(grads(model))
        opt.step()
        rec["params"].append(params(model))
    return rec


SCHEDULES = {"no_sync": accumulate_in_no_sync, "no_zero_grad": accumulate_without_zero_grad}


def no_shard_accumulation_worker() -> dict:
    """NO_SHARD + ``MixedPrecision(param_dtype=bf16)``: both accumulation schedules, flat and original gradients.

    Returns ``{(schedule, use_orig_params): {"ours": record, "torch": record}}``."""
    out = {}
    for schedule, run in SCHEDULES.items():
        for orig in (False, True):
            ours, theirs = fsdp_pair("mlp", minifsdp.ShardingStrategy.NO_SHARD, BF16, use_orig_params=orig)
            out[(schedule, orig)] = {"ours": run(ours), "torch": run(theirs)}
    return to_numpy(out)


def small_fp16_grads(model, steps: int = 3, scale: float = 1e-4) -> dict:
    """fp16 compute and reduce, the loss times ``scale``: gradients near fp16's smallest normal (6.1e-5),
    where each divide before the sum rounds away low bits."""
    rank, world = dist.get_rank(), dist.get_world_size()
    opt, rec = _sgd(model), {"grads": [], "params": [], "losses": []}
    for step in range(steps):
        x, y = batch("mlp", step, rank, world)
        loss = loss_of("mlp", model, x, y) * scale
        loss.backward()
        rec["losses"].append(loss.item())
        rec["grads"].append(grads(model))
        opt.step()
        opt.zero_grad()
        rec["params"].append(params(model))
    return rec


def fp16_small_grads_worker(strategies: list[str]) -> dict:
    """``MixedPrecision(param_dtype=fp16, reduce_dtype=fp16)``, small gradients, each strategy; ours and torch's."""
    out = {}
    for name in strategies:
        ours, theirs = fsdp_pair("mlp", minifsdp.ShardingStrategy[name], FP16)
        out[name] = {"ours": small_fp16_grads(ours), "torch": small_fp16_grads(theirs)}
    return to_numpy(out)
