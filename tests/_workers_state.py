"""Rank function for tests/test_fsdp_state.py: a unit's TrainingState and its handle's HandleState, step by step."""

from __future__ import annotations

import functools

import torch

from minifsdp.fsdp import FSDP
from minifsdp.fsdp.core.units import clean_name, units
from minifsdp.fsdp.torch_options import size_based_auto_wrap_policy
from minifsdp.models import MLP


def _names(model):
    return {id(m): clean_name(n) or "root" for n, m in model.named_modules()}


def _states(model) -> dict:
    """{unit: (training state, handle state)} for every unit of ``model``."""
    names = _names(model)
    return {names[id(u)]: (u.training_state.name, u._handle.state.name if u._handle is not None else None)
            for u in units(model)}


def state_trace_worker() -> dict:
    """MLP(16, 32, 32, 8), net.0 and net.2 their own units (>= 500 parameters), FULL_SHARD on 2 ranks."""
    model = FSDP(MLP((16, 32, 32, 8), seed=0), auto_wrap_policy=functools.partial(size_based_auto_wrap_policy,
                                                                                   min_num_params=500))
    out = {"after_wrap": _states(model)}
    x, y = model.module.batch(0, 4)
    with torch.no_grad():
        model(x)
    out["after_no_grad_forward"] = _states(model)

    inner = model.module.net[2]  # the FSDP unit; record what every unit is in while its module runs
    inner.module.register_forward_pre_hook(lambda m, a: out.__setitem__("inside_net2_forward", _states(model)))
    loss = torch.nn.functional.mse_loss(model(x), y)
    out["after_forward"] = _states(model)
    with FSDP.summon_full_params(model):
        out["inside_summon"] = _states(model)
    out["after_summon"] = _states(model)

    trace = []
    for unit in units(model):
        h = unit._handle
        orig = h.gradient.start_reduce  # the unit's gradient (core/gradient.py) starts its reduction

        def start_reduce(orig=orig, h=h):
            trace.append((h.name, _states(model)))
            orig()

        h.gradient.start_reduce = start_reduce
    loss.backward()
    out["at_each_reduce"] = trace
    out["after_backward"] = _states(model)
    return out
