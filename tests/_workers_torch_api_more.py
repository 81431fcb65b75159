"""Rank functions for tests/test_torch_api_more.py: torch-FSDP1 user code run on torch and on ours.

Same pattern as ``tests/_workers_torch_api.py`` (whose :class:`Side`, models and data it reuses):
a case is ``case_<name>(api, *args) -> result``, written only against torch FSDP1's public API,
and :func:`both` runs it on torch's FSDP1 and on ours from the same seed.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests._workers_torch_api import Side, batch, full_params, mlp


def error_line(fn):
    """``fn()``'s result, or ``(error type, first line of its message)`` if it raises."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - the error is the result
        return (type(e).__name__, str(e).splitlines()[0] if str(e) else "")


def both(case: str, *args) -> dict:
    """Run ``case_<case>`` on torch's FSDP1 and on ours; ``{"torch": ..., "ours": ...}``."""
    return {side: globals()[f"case_{case}"](Side(side == "ours"), *args) for side in ("torch", "ours")}


def _grads(model) -> list:
    return [(n, None if p.grad is None else p.grad.clone()) for n, p in model.named_parameters()]


# ---------------------------------------------------------------- freezing after wrapping
def case_freeze_after_wrap(api):
    """use_orig_params=True; after wrapping, freeze one weight of a unit (its bias still trains) and the
    whole root unit (Linear(11, 3)); SGD with momentum and weight decay would move a parameter whose
    gradient were zeros rather than None.  Then unfreeze the weight: it trains again."""
    model = api.wrap(mlp(), use_orig_params=True)
    model[2].weight.requires_grad_(False)
    for p in model[4].parameters():
        p.requires_grad_(False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.1)
    out = {"grads": [], "rank": dist.get_rank()}
    for step in range(3):
        if step == 2:
            model[2].weight.requires_grad_(True)
        x, y = batch(step, dist.get_rank())
        F.mse_loss(model(x), y).backward()
        out["grads"].append(_grads(model))
        opt.step()
        opt.zero_grad()
    out["full"] = full_params(api, model)
    return out


# ---------------------------------------------------------------- model.half() / .to(dtype) / .double()
def _convert(model, how: str) -> torch.dtype:
    if how == "half":
        model.half()
    elif how == "to_float16":
        model.to(torch.float16)
    else:
        model.double()
    return torch.float64 if how == "double" else torch.float16


def case_convert(api, orig: bool, how: str, before_first_forward: bool):
    """Convert the wrapped model's dtype.  Before its first forward: it then trains in that dtype (torch
    allocates its gather buffers at that forward).  After: torch's forward raises a ValueError."""
    model = api.wrap(mlp(), use_orig_params=orig)
    rank = dist.get_rank()
    if not before_first_forward:
        x, y = batch(0, rank)
        F.mse_loss(model(x), y).backward()
    dtype = _convert(model, how)
    out = {"params": [(n, p.dtype, tuple(p.shape)) for n, p in model.named_parameters()]}
    if not before_first_forward:
        x, y = batch(1, rank)
        err = error_line(lambda: model(x.to(dtype)))
        out["error"] = err[0]
        out["names_fix"] = api.ours and "before its first forward" in err[1]
        return out
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out["losses"], out["grads"] = [], []
    for step in range(2):
        x, y = batch(step, rank)
        loss = F.mse_loss(model(x.to(dtype)), y.to(dtype))
        loss.backward()
        out["losses"].append(loss.detach().clone())
        out["grads"].append(_grads(model))
        opt.step()
        opt.zero_grad()
    out["full"] = full_params(api, model)
    return out
