"""Rank functions for tests/test_torch_api_more.py: torch-FSDP1 user code run on torch and on ours.

Same pattern as ``tests/_workers_torch_api.py`` (whose :class:`Side`, models and data it reuses):
a case is ``case_<name>(api, *args) -> result``, written only against torch FSDP1's public API,
and :func:`both` runs it on torch's FSDP1 and on ours from the same seed.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import CPUOffload

from tests._workers_torch_api import Side, batch, full_params, mlp, train


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


# ---------------------------------------------------------------- ShardedGradScaler
def _scaler_class(api):
    if api.ours:
        from minifsdp import ShardedGradScaler
        return ShardedGradScaler
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
    return ShardedGradScaler


def case_scaler(api, orig: bool):
    """fp16 gradients (``keep_low_precision_grads``), two optimizers, torch's GradScaler API; an inf in
    rank 1's gradients only at step 1 (both ranks skip, the scale backs off), growth after 2 clean steps,
    the settings changed and read back, a state dict saved and loaded into a fresh scaler."""
    mp = api.MixedPrecision(param_dtype=torch.float16, keep_low_precision_grads=True)
    model = api.wrap(mlp(), use_orig_params=orig, mixed_precision=mp)
    params = list(model.parameters())
    opts = [torch.optim.SGD(params[:1], lr=0.1, foreach=False), torch.optim.SGD(params[1:], lr=0.1, foreach=False)]
    scaler = _scaler_class(api)(device="cpu", init_scale=2.0**10, growth_interval=2)
    rank, out = dist.get_rank(), {"scales": [], "stepped": [], "grads": []}
    for step in range(6):
        if step == 4:
            scaler.set_growth_factor(4.0)
            scaler.set_backoff_factor(0.25)
            scaler.set_growth_interval(1)
        x, y = batch(step, rank)
        scaled = scaler.scale(F.mse_loss(model(x), y))
        out.setdefault("scaled", []).append(scaled.detach().clone())
        scaled.backward()
        if step == 1 and rank == 1:
            next(p for p in params if p.grad is not None and p.grad.numel()).grad.view(-1)[0] = float("inf")
        if step == 3:  # torch's pattern for clipping: unscale first, then step
            scaler.unscale_(opts[0])
            out["twice"] = error_line(lambda: scaler.unscale_(opts[0]))
        out["grads"].append([None if p.grad is None else (p.grad.dtype, p.grad.clone()) for p in params])
        stepped = []
        for opt in opts:  # each optimizer skips on its own gradients' flag (all-reduced), as torch
            before = [p.detach().clone() for p in opt.param_groups[0]["params"]]
            scaler.step(opt)
            stepped.append(not all(torch.equal(b, p) for b, p in zip(before, opt.param_groups[0]["params"])))
        out["stepped"].append(stepped)
        out["step_twice"] = error_line(lambda: scaler.step(opts[0]))
        scaler.update()
        out["scales"].append(scaler.get_scale())
        for opt in opts:
            opt.zero_grad()
    out["settings"] = (scaler.get_growth_factor(), scaler.get_backoff_factor(), scaler.get_growth_interval(),
                       scaler.is_enabled())
    out["state"] = scaler.state_dict()
    fresh = _scaler_class(api)(device="cpu")
    fresh.load_state_dict(out["state"])
    out["loaded"] = fresh.state_dict()
    scaler.update(3.0)
    out["new_scale"] = scaler.get_scale()
    off = _scaler_class(api)(device="cpu", enabled=False)
    out["disabled"] = (off.is_enabled(), off.get_scale(), off.state_dict(), off.scale(torch.ones(2)).tolist(),
                       error_line(lambda: off.load_state_dict({"scale": 1.0})),
                       error_line(lambda: fresh.load_state_dict({}))[0])
    out["full"] = full_params(api, model)
    return out


# ---------------------------------------------------------------- names with use_orig_params=True
def _named(module) -> list:
    return [(n, tuple(p.shape), isinstance(p, torch.nn.Parameter)) for n, p in module.named_parameters()]


def case_names(api):
    """``named_parameters()`` with use_orig_params=True: between steps (local pieces, wrapper prefixes),
    inside the forward of a unit (the running units' parameters in full shape, as plain tensors), inside
    ``summon_full_params`` (clean names, full shapes, of the whole model and of one unit), after."""
    model = api.wrap(mlp(), use_orig_params=True)
    out = {"outside": _named(model)}

    def look(_module, _args):
        out["forward"], out["forward_inner"] = _named(model), _named(model[2].module)

    model[2].module.register_forward_pre_hook(look)
    x, y = batch(0, dist.get_rank())
    F.mse_loss(model(x), y).backward()
    with api.FSDP.summon_full_params(model):
        out["summon"] = _named(model)
    with api.FSDP.summon_full_params(model[2]):
        out["summon_unit"] = _named(model)
    out["after"] = _named(model)
    return out


# ---------------------------------------------------------------- torch's NonUniformReqGradNWM
def case_nonuniform_req_grad(api, with_step: bool):
    """torch's own test model (``common_fsdp.NonUniformReqGradNWM``, its module-global ``FSDP`` pointed at
    ours or torch's while it wraps): use_orig_params=True, MixedPrecision(param_dtype=float16), everything
    frozen after wrapping but ``module.2.1`` (which lies on rank 1 only: rank 0 has no gradient at all);
    one forward and backward (with a ShardedGradScaler step), then the full state dict."""
    from torch.distributed.distributed_c10d import _get_default_group
    from torch.testing._internal import common_fsdp as cf

    kw = dict(use_orig_params=True, mixed_precision=api.MixedPrecision(param_dtype=torch.float16),
              device_id=torch.device("cpu"))
    group, wrap_with = _get_default_group(), cf.FSDP
    cf.FSDP = api.FSDP
    try:
        model = cf.NonUniformReqGradNWM.init(group, cf.FSDPInitMode.RECURSIVE, cf.DEVICEInitMode.DEVICE_NEVER,
                                             fsdp_kwargs=kw, deterministic=True)
    finally:
        cf.FSDP = wrap_with
    model = api.FSDP(model, group, **kw)
    out = {"requires_grad": [(n, p.requires_grad) for n, p in model.named_parameters()]}
    torch.manual_seed(1 + dist.get_rank())
    x = torch.rand(4, 8)
    scaler = _scaler_class(api)(device="cpu", init_scale=2.0**4) if with_step else None
    loss = model(x).sum()
    (scaler.scale(loss) if with_step else loss).backward()
    out["loss"] = loss.detach().clone()
    out["grads"] = _grads(model)
    if with_step:
        scaler.step(torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1))
        scaler.update()
        out["scale"] = scaler.get_scale()
    out["state_dict"] = {k: v.clone() for k, v in model.state_dict().items()}
    return out


# ---------------------------------------------------------------- a plain root above FSDP units
class _PlainRoot(torch.nn.Module):
    """A plain module whose children are FSDP units (one with nested units), a plain Linear and a BatchNorm."""

    def __init__(self, api, seed: int, orig: bool):
        super().__init__()
        torch.manual_seed(seed)
        self.body = api.wrap(mlp(seed), use_orig_params=orig)
        self.head = api.wrap(torch.nn.Linear(3, 3), auto_wrap=False, use_orig_params=orig)
        self.plain = torch.nn.Linear(3, 3)
        self.norm = torch.nn.BatchNorm1d(3)

    def forward(self, x):
        return self.norm(self.plain(self.head(self.body(x))))


def case_plain_root_state_dict(api, kind: str, orig: bool):
    """``root.state_dict()`` / ``root.load_state_dict(sd)`` where ``root`` is a plain module above FSDP units,
    under each ``StateDictType``: a trained model's dict loaded into a fresh one (other seed), which then trains
    on; also a dict with an extra key, and one with a key missing (strict)."""
    from torch.distributed.fsdp import StateDictType

    sdt = getattr(StateDictType, kind)
    trained = _PlainRoot(api, 0, orig)
    losses = train(trained, torch.optim.SGD(trained.parameters(), lr=0.1), steps=2)
    with api.FSDP.state_dict_type(trained, sdt):
        sd = trained.state_dict()
    fresh = _PlainRoot(api, 1, orig)
    out = {"keys": list(sd), "losses": losses, "whole_values": [k for k, v in sd.items() if type(v) is torch.Tensor
                                                                 or isinstance(v, torch.nn.Parameter)]}
    with api.FSDP.state_dict_type(fresh, sdt):
        result = fresh.load_state_dict(sd)
        out["result"] = (list(result.missing_keys), list(result.unexpected_keys))
        extra = dict(sd, extra_key=torch.zeros(1))
        out["extra"] = error_line(lambda: fresh.load_state_dict(extra))[0]
        missing = {k: v for k, v in sd.items() if k != "plain.bias"}
        out["missing"] = error_line(lambda: fresh.load_state_dict(missing))[0]
        out["missing_lax"] = list(fresh.load_state_dict(missing, strict=False).missing_keys)
    out["resumed_losses"] = train(fresh, torch.optim.SGD(fresh.parameters(), lr=0.1), steps=2, first=2)
    out["more_losses"] = train(trained, torch.optim.SGD(trained.parameters(), lr=0.1), steps=2, first=2)
    with api.FSDP.state_dict_type(fresh, StateDictType.FULL_STATE_DICT):
        out["full"] = {k: v.clone() for k, v in fresh.state_dict().items()}
    return out


# ---------------------------------------------------------------- use_orig_params write-back
def _first_linear(model):
    return next(m for m in model.modules() if isinstance(m, torch.nn.Linear))


def case_writeback(api, strategy: str, how: str):
    """use_orig_params=True: after a step the user gives the first Linear's weight new storage (``.data =``), a
    new Parameter under its name, or a new ``.grad`` before the step; training then goes on (a new optimizer over
    ``model.parameters()``).  Also what each name's shape is right after a forward, before its backward."""
    model = api.wrap(mlp(0), use_orig_params=True, sharding_strategy=getattr(api.ShardingStrategy, strategy))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = {"losses": train(model, opt, steps=1)}
    lin = _first_linear(model)
    if how == "data":
        lin.weight.data = lin.weight.detach() * 2 + 1
    elif how == "param":
        lin.weight = torch.nn.Parameter(lin.weight.detach() * 2 + 1)
    elif how == "grad":
        x, y = batch(7, dist.get_rank())
        F.mse_loss(model(x), y).backward()
        for p in model.parameters():
            if p.grad is not None:
                p.grad = p.grad * 3  # new storage
        opt.step()
        opt.zero_grad()
    x, y = batch(8, dist.get_rank())
    loss = F.mse_loss(model(x), y)
    out["shapes_after_forward"] = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    loss.backward()
    out["shapes_after_backward"] = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt.step()
    opt.zero_grad()
    out["losses"] += train(model, opt, steps=2, first=2)
    out["full"] = full_params(api, model)
    return out


def case_writeback_errors(api, how: str):
    """Where torch FSDP1 refuses a write-back: a piece of another shape (FULL_SHARD, at the next forward), and
    any change between forward and backward under SHARD_GRAD_OP (at the backward)."""
    strategy = api.ShardingStrategy.SHARD_GRAD_OP if how == "between" else api.ShardingStrategy.FULL_SHARD
    model = api.wrap(mlp(0), use_orig_params=True, sharding_strategy=strategy)
    train(model, torch.optim.SGD(model.parameters(), lr=0.1), steps=1)
    x, y = batch(8, dist.get_rank())
    lin = _first_linear(model)
    if how == "shape":
        lin.weight.data = torch.zeros(lin.weight.numel() + 1)
        return error_line(lambda: F.mse_loss(model(x), y).backward())[0]
    loss = F.mse_loss(model(x), y)
    lin.weight.data = lin.weight.detach() * 2
    return error_line(lambda: loss.backward())[0]


def case_two_optimizers(api, strategy: str):
    """use_orig_params=True with two optimizers over one model (SGD on the weights, Adam on the biases), one
    zeroing its gradients to None and the other to zeros, as torch's own test of it does."""
    model = api.wrap(mlp(0), use_orig_params=True, sharding_strategy=getattr(api.ShardingStrategy, strategy))
    named = list(model.named_parameters())
    weights = [p for n, p in named if n.endswith("weight")]
    biases = [p for n, p in named if n.endswith("bias")]
    opts = [(torch.optim.SGD(weights, lr=0.1), True), (torch.optim.Adam(biases, lr=0.01), False)]
    out = {"losses": [], "grads": []}
    for step in range(3):
        x, y = batch(step, dist.get_rank())
        loss = F.mse_loss(model(x), y)
        loss.backward()
        out["losses"].append(loss.item())
        out["grads"].append(_grads(model))
        for opt, to_none in opts:
            opt.step()
            opt.zero_grad(set_to_none=to_none)
    out["full"] = full_params(api, model)
    return out


def case_summon_with_grads_edit(api, strategy: str, writeback: bool):
    """``summon_full_params(with_grads=True)`` after a backward: the full gradients seen inside, each doubled in
    place there; then the gradients after the context and the parameters after an SGD step."""
    model = api.wrap(mlp(0), use_orig_params=True, sharding_strategy=getattr(api.ShardingStrategy, strategy))
    x, y = batch(0, dist.get_rank())
    F.mse_loss(model(x), y).backward()
    out = {}
    with api.FSDP.summon_full_params(model, with_grads=True, writeback=writeback):
        out["inside"] = _grads(model)
        for p in model.parameters():
            if p.grad is not None:
                p.grad.mul_(2)
    out["after"] = _grads(model)
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    out["full"] = full_params(api, model)
    return out


# ---------------------------------------------------------------- a wrap torch refuses, with parameter offload
def case_offload_refused_after_torch_s_wrap_errors(api, manual: bool = False):
    """``CPUOffload(offload_params=True)`` and a unit that mixes a frozen weight with its trainable bias
    (use_orig_params=False): torch's wrapping raises its ValueError ('Must flatten tensors with uniform
    requires_grad') before the offload could fail, so ours raises that, not its refusal of the offload.
    ``manual``: the last Linear wrapped by hand first (a unit torch accepts), then the root that mixes them."""
    model = mlp()
    model[0].weight.requires_grad_(False)
    offload = dict(auto_wrap=not manual, cpu_offload=CPUOffload(offload_params=True))

    def wrap():
        if manual:
            model[4] = api.wrap(model[4], **offload)
        api.wrap(model, **offload)
    raised = error_line(wrap)
    return {"wrap": raised and raised[0]}  # (None: it wrapped)


def many(cases: list[tuple]) -> list:
    """:func:`both` for each ``(case, *args)`` in one spawn; a case that raises (on every rank alike) gives
    ``{"error": "Type: first line"}`` and the next case still runs."""
    out = []
    for case, *args in cases:
        try:
            out.append(both(case, *args))
        except Exception as e:  # noqa: BLE001 - the error is the result
            out.append({"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]})
    return out
