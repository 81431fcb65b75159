"""Rank functions for tests/test_torch_api.py: the same torch-FSDP1 user code run on torch and on ours.

Every case is a function ``case(api, *args) -> result`` written only against torch FSDP1's public
API, reached through ``api`` (:class:`Side`): ``api.FSDP`` is torch's ``FullyShardedDataParallel``
or ours, ``api.MixedPrecision`` and ``api.ShardingStrategy`` likewise.  The state-dict enum and
config classes are torch's on both sides (ours re-exports them: ``minifsdp.fsdp.state_dict_type``).
:func:`both` runs a case on each side, on fresh models built from the same seed.
"""

from __future__ import annotations

import copy
import functools
import warnings

import torch
import torch.distributed as dist
import torch.distributed.fsdp as tfsdp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import (
    CPUOffload,
    FullOptimStateDictConfig,
    FullStateDictConfig,
    LocalStateDictConfig,
    ShardedStateDictConfig,
    StateDictType,
)
from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy as torch_size_policy

import minifsdp
from minifsdp.fsdp.torch_options import size_based_auto_wrap_policy

STEPS = 2


class Side:
    """torch FSDP1 (``ours=False``) or minifsdp (``ours=True``), behind the same names."""

    def __init__(self, ours: bool):
        self.ours = ours
        mod = minifsdp if ours else tfsdp
        self.FSDP = mod.FullyShardedDataParallel
        self.MixedPrecision = mod.MixedPrecision
        self.ShardingStrategy = mod.ShardingStrategy
        self.policy = functools.partial(size_based_auto_wrap_policy if ours else torch_size_policy,
                                        min_num_params=40)

    def wrap(self, model, auto_wrap=True, **kwargs):
        if auto_wrap:
            kwargs.setdefault("auto_wrap_policy", self.policy)
        kwargs.setdefault("device_id", torch.device("cpu"))
        return self.FSDP(model, **kwargs)


def mlp(seed: int = 0) -> nn.Sequential:
    """Linear(5, 13) -> ReLU -> Linear(13, 11) -> ReLU -> Linear(11, 3): no world size in {2, 3} divides them."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 13), nn.ReLU(), nn.Linear(13, 11), nn.ReLU(), nn.Linear(11, 3))


def bn_mlp(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 13), nn.BatchNorm1d(13), nn.ReLU(), nn.Linear(13, 3))


def batch(step: int, rank: int, rows: int = 4):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(rows, 5, generator=g), torch.randn(rows, 3, generator=g)


def train(model, opt, steps: int = STEPS, first: int = 0) -> list[float]:
    rank, losses = dist.get_rank(), []
    for step in range(first, first + steps):
        x, y = batch(step, rank)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def full_params(api, model) -> list:
    with api.FSDP.summon_full_params(model):
        return [(n, p.detach().clone()) for n, p in model.named_parameters()]


def error_of(fn) -> str | None:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the error is the result
        return type(e).__name__
    return None


def both(case: str, *args) -> dict:
    """Run ``CASES[case]`` on torch's FSDP1 and on ours; ``{"torch": ..., "ours": ...}``."""
    return {side: globals()[f"case_{case}"](Side(side == "ours"), *args) for side in ("torch", "ours")}


# ---------------------------------------------------------------- item 1: state_dict_type
def _plain(sd) -> dict:
    return {k: (v.dtype, tuple(v.shape), v.detach().clone()) for k, v in sd.items()}


def case_full_state_dict(api, offload: bool, rank0_only: bool, orig: bool, mp: bool):
    model = api.wrap(bn_mlp(), use_orig_params=orig,
                     mixed_precision=api.MixedPrecision(param_dtype=torch.float16, buffer_dtype=torch.float16)
                     if mp else None)
    train(model, torch.optim.SGD(model.parameters(), lr=0.1))
    cfg = FullStateDictConfig(offload_to_cpu=offload, rank0_only=rank0_only)
    if not api.ours and offload:
        # torch FSDP1 on a CPU-only run fails here (offloading a CPU tensor "to CPU" frees the full
        # parameter it still reads: "setStorage ... out of bounds for storage of size 0"); on CPU the
        # offload moves nothing, so the oracle is torch's offload_to_cpu=False.
        cfg = FullStateDictConfig(offload_to_cpu=False, rank0_only=rank0_only)
    with api.FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, cfg):
        sd = model.state_dict()
    out = {"keys": list(sd), "values": _plain(sd)}
    with api.FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, cfg):
        if not rank0_only:  # load it back after a change: the full parameters are the saved ones again
            with api.FSDP.summon_full_params(model):
                for p in model.parameters():
                    p.data.add_(1.0)
            model.load_state_dict(sd)
    out["after_load"] = full_params(api, model)
    return out


def case_sharded_state_dict(api, orig: bool):
    """SHARDED: each rank's dim-0 chunk of every parameter; it loads back into a model trained further."""
    model = api.wrap(mlp(), use_orig_params=orig)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    train(model, opt)
    with api.FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT, ShardedStateDictConfig()):
        sd = model.state_dict()
    local = {}
    for k, v in sd.items():
        if hasattr(v, "local_shards"):  # torch: a ShardedTensor
            shards = v.local_shards()
            local[k] = shards[0].tensor.clone() if shards else torch.empty(0)
        elif hasattr(v, "to_local"):  # a DTensor
            local[k] = v.to_local().clone()
        else:
            local[k] = v.clone()
    saved = full_params(api, model)
    train(model, opt, first=10)
    with api.FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        model.load_state_dict(sd)
    return {"keys": list(sd), "local": local, "saved": saved, "loaded": full_params(api, model)}


def case_local_state_dict(api):
    model = api.wrap(mlp())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    train(model, opt)
    with api.FSDP.state_dict_type(model, StateDictType.LOCAL_STATE_DICT, LocalStateDictConfig()):
        sd = model.state_dict()
    local = {k: (v.local_shards()[0].tensor if hasattr(v, "local_shards") else v).clone() for k, v in sd.items()}
    kept = copy.deepcopy(sd)  # a snapshot: like nn.Module's, the state dict's tensors are the live parameters
    saved = full_params(api, model)
    train(model, opt, first=10)
    continued = full_params(api, model)
    api.FSDP.set_state_dict_type(model, StateDictType.LOCAL_STATE_DICT)
    model.load_state_dict(sd)
    aliased = full_params(api, model)
    model.load_state_dict(kept)
    return {"keys": list(sd), "local": local, "saved": saved, "continued": continued, "aliased": aliased,
            "loaded": full_params(api, model)}


def _optimizer(name, params):
    if name == "adam":
        return torch.optim.Adam(params, lr=0.01)
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def case_optim_state_dict(api, orig: bool, rank0_only: bool, name: str = "adam"):
    """FULL optimizer state (Adam: a step count and two moments per parameter), then loaded into a fresh run."""
    model = api.wrap(mlp(), use_orig_params=orig)
    opt = _optimizer(name, model.parameters())
    train(model, opt)
    with api.FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, FullStateDictConfig(),
                                  FullOptimStateDictConfig(rank0_only=rank0_only)):
        osd = api.FSDP.optim_state_dict(model, opt)
        msd = model.state_dict()
    # copied now, as a checkpoint would be (torch's dict may share tensors with the live optimizer state)
    out = {"state": {k: {kk: vv.clone() if torch.is_tensor(vv) else vv for kk, vv in v.items()}
                     for k, v in osd.get("state", {}).items()},
           "groups": osd.get("param_groups")}
    if not rank0_only:
        fresh = api.wrap(mlp(seed=1), use_orig_params=orig)
        fresh_opt = _optimizer(name, fresh.parameters())
        with api.FSDP.state_dict_type(fresh, StateDictType.FULL_STATE_DICT):
            fresh.load_state_dict(msd)
            fresh_opt.load_state_dict(api.FSDP.optim_state_dict_to_load(fresh, fresh_opt, osd))
        out["resumed"] = train(fresh, fresh_opt, first=5)
        out["continued"] = train(model, opt, first=5)
    return out


# ---------------------------------------------------------------- items 2, 3: indexing, traversal, apply
def case_getitem(api):
    model = api.wrap(mlp())
    first, last = model[0], model[-1]
    return {"types": [type(first).__name__ == "FullyShardedDataParallel", type(model[1]).__name__],
            "last_is_unit": isinstance(last, api.FSDP)}


def case_fsdp_modules(api, orig: bool):
    model = api.wrap(mlp(), use_orig_params=orig)
    names = {id(m): n for n, m in model.named_modules()}
    return {"all": [names[id(m)] for m in api.FSDP.fsdp_modules(model)],
            "roots": [names[id(m)] for m in api.FSDP.fsdp_modules(model, root_only=True)],
            "inner": [names[id(m)] for m in api.FSDP.fsdp_modules(model[0])],
            "flat": [None if m._flat_param is None else m._flat_param.detach().clone()
                     for m in api.FSDP.fsdp_modules(model)]}


def case_apply(api):
    """``model.apply(init)`` before the first forward sees (and writes back) full parameters."""
    model = api.wrap(mlp())
    shapes = []

    def init(m):
        if isinstance(m, nn.Linear):
            shapes.append(tuple(m.weight.shape))
            with torch.no_grad():
                m.weight.fill_(0.5)
                m.bias.zero_()

    model.apply(init)
    return {"shapes": shapes, "full": full_params(api, model)}


# ---------------------------------------------------------------- item 4: constructor keywords
def case_offload_params(api):
    """CPUOffload(offload_params=True) on a CPU-only machine: torch fails; so do we, with the same type."""
    def go():
        model = api.wrap(mlp(), cpu_offload=CPUOffload(offload_params=True))
        train(model, torch.optim.SGD(model.parameters(), lr=0.1))
    try:
        go()
    except Exception as e:  # noqa: BLE001 - the error is the result
        return {"type": type(e).__name__, "names_fix": "offload_params=False" in str(e)}
    return None


def case_constructor(api, kind: str):
    kwargs = {"cpu_offload": dict(cpu_offload=CPUOffload()),
              "strategy_none": dict(sharding_strategy=None),
              "device_id": dict(device_id=torch.device("cpu"))}[kind]
    model = api.wrap(mlp(), **kwargs)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = train(model, opt)
    return {"losses": losses, "local": [p.detach().clone() for p in model.parameters()],
            "full": full_params(api, model)}


# ---------------------------------------------------------------- item 5: summon_full_params's arguments
def _inside(model) -> list:
    return [(n, tuple(p.shape), p.detach().clone(), None if p.grad is None else p.grad.clone())
            for n, p in model.named_parameters()]


def case_summon(api, orig: bool, kind: str):
    model = api.wrap(mlp(), use_orig_params=orig)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    train(model, opt)
    x, y = batch(7, dist.get_rank())
    F.mse_loss(model(x), y).backward()  # gradients left in place (no zero_grad)
    summon = functools.partial(api.FSDP.summon_full_params, model)
    out = {}
    if kind == "writeback_false":
        with summon(writeback=False):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1.0)
    elif kind == "rank0_only":
        with summon(rank0_only=True, writeback=False):
            out["inside"] = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    elif kind == "offload":  # torch FSDP1 on a CPU-only run fails with offload_to_cpu=True (setStorage out of
        # bounds / a Split view modified in place); on CPU nothing moves, so its oracle is offload_to_cpu=False
        with summon(offload_to_cpu=api.ours, rank0_only=True, writeback=False):
            out["inside"] = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    elif kind == "with_grads":
        with summon(with_grads=True):
            out["inside"] = _inside(model)
        out["grads_after"] = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
    elif kind == "recurse_false":
        with api.FSDP.summon_full_params(model[0], recurse=False):
            out["inside"] = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    elif kind == "errors":
        out["rank0_writeback"] = error_of(lambda: summon(rank0_only=True, writeback=True).__enter__())
        if not orig:
            out["grads_without_orig"] = error_of(lambda: summon(with_grads=True).__enter__())
    opt.step()
    out["full"] = full_params(api, model)
    return out


# ---------------------------------------------------------------- item 6: keep_low_precision_grads
def case_keep_low_precision_grads(api, orig: bool, strategy: str):
    mp = api.MixedPrecision(param_dtype=torch.float16, keep_low_precision_grads=True)
    model = api.wrap(mlp(), use_orig_params=orig, mixed_precision=mp,
                     sharding_strategy=getattr(api.ShardingStrategy, strategy))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, foreach=False)
    grads = []
    for step in range(STEPS):
        x, y = batch(step, dist.get_rank())
        F.mse_loss(model(x), y).backward()
        grads.append([(p.grad.dtype, p.grad.clone()) if p.grad is not None else None for p in model.parameters()])
        opt.step()
        opt.zero_grad()
    return {"grads": grads, "full": full_params(api, model)}


# ---------------------------------------------------------------- item 4: ignored modules
def case_ignored(api, orig: bool, as_states: bool):
    model = mlp()
    ignored = [model[2]]
    kw = dict(ignored_states=ignored) if as_states else dict(ignored_modules=ignored)
    model = api.wrap(model, use_orig_params=orig, **kw)
    local = [(tuple(p.shape), p.detach().clone()) for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = train(model, opt)
    with api.FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT):
        sd = model.state_dict()
    x, y = batch(9, dist.get_rank())
    F.mse_loss(model(x), y).backward()  # the ignored layer's gradient is local: it counts in the norm as is
    total = model.clip_grad_norm_(0.01)
    return {"local": local, "losses": losses, "sd": _plain(sd), "ignored": model[2].weight.detach().clone(),
            "full": full_params(api, model), "total": total,
            "clipped": [None if p.grad is None else p.grad.clone() for p in model.parameters()]}


def case_state_dict_aliases(api, orig: bool):
    """Which FULL state-dict values share storage with the module's own tensors: an ignored module's parameters
    and the buffers (as ``nn.Module.state_dict``); never a parameter FSDP gathered (it is freed after)."""
    model = bn_mlp()
    model = api.wrap(model, use_orig_params=orig, ignored_modules=[model[3]])
    train(model, torch.optim.SGD(model.parameters(), lr=0.1))
    own = {n: t.untyped_storage().data_ptr() for n, t in list(model.named_parameters()) + list(model.named_buffers())}
    own = {k.replace("_fsdp_wrapped_module.", ""): v for k, v in own.items()}
    with api.FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT):
        sd = model.state_dict()
    return {"aliases": {k: own.get(k) == v.untyped_storage().data_ptr() for k, v in sd.items()},
            "values": _plain(sd)}


# ---------------------------------------------------------------- item 7: behaviours
def case_no_sync_grads(api, orig: bool):
    model = api.wrap(mlp(), use_orig_params=orig)
    rank, out = dist.get_rank(), {}
    with model.no_sync():
        for step in range(2):
            x, y = batch(step, rank)
            F.mse_loss(model(x), y).backward()
            out[f"inside{step}"] = [(n, None if p.grad is None else p.grad.clone())
                                    for n, p in model.named_parameters()]
    x, y = batch(5, rank)
    F.mse_loss(model(x), y).backward()
    out["synced"] = [(n, None if p.grad is None else p.grad.clone()) for n, p in model.named_parameters()]
    return out


def case_clip_inf(api, norm_type: float):
    """use_orig_params=True at 3 ranks: Linear(13, 11)'s bias lies on the last rank only (grad None elsewhere)."""
    model = api.wrap(mlp(), use_orig_params=True)
    x, y = batch(0, dist.get_rank())
    F.mse_loss(model(x), y).backward()
    grads = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
    total = model.clip_grad_norm_(0.01, norm_type=norm_type)
    return {"grads": grads, "total": total, "clipped": [None if p.grad is None else p.grad.clone()
                                                          for p in model.parameters()]}


def case_clip_low_precision_grads(api, orig: bool):
    """bf16 gradient shards (``keep_low_precision_grads=True``): the total norm comes back in their dtype."""
    mp = api.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16, keep_low_precision_grads=True)
    model = api.wrap(mlp(), use_orig_params=orig, mixed_precision=mp)
    x, y = batch(0, dist.get_rank())
    F.mse_loss(model(x), y).backward()
    total = model.clip_grad_norm_(0.01)
    return {"total": total, "clipped": [None if p.grad is None else p.grad.clone() for p in model.parameters()]}


def case_clip_no_grads(api):
    model = api.wrap(mlp())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        total = model.clip_grad_norm_(1.0)
    return {"total": total, "warned": [str(w.message).split(" -- ")[0].replace(f"rank {dist.get_rank()}", "rank r")
                                       for w in caught if "no gradients" in str(w.message)]}


# ---------------------------------------------------------------- item 8: errors torch raises
def case_errors(api, kind: str):
    if kind == "mixed_orig_params":
        torch.manual_seed(0)
        inner = api.FSDP(nn.Linear(5, 13), use_orig_params=True, device_id=torch.device("cpu"))
        model = api.FSDP(nn.Sequential(inner, nn.Linear(13, 3)), use_orig_params=False,
                         device_id=torch.device("cpu"))
        return error_of(lambda: model(batch(0, 0)[0]))
    model = api.wrap(mlp())
    x, y = batch(0, dist.get_rank())
    if kind == "summon_in_forward":
        model[2].register_forward_pre_hook(lambda m, a: api.FSDP.summon_full_params(model).__enter__())
        return error_of(lambda: model(x))
    out = model(x)
    out.register_hook(lambda g: api.FSDP.summon_full_params(model).__enter__())
    return error_of(lambda: F.mse_loss(out, y).backward())


def case_torch_enums(api):
    """torch's own ShardingStrategy, BackwardPrefetch and MixedPrecision, passed to either FSDP."""
    model = api.wrap(mlp(), sharding_strategy=tfsdp.ShardingStrategy.SHARD_GRAD_OP,
                     backward_prefetch=tfsdp.BackwardPrefetch.BACKWARD_POST,
                     mixed_precision=tfsdp.MixedPrecision(param_dtype=torch.float16, reduce_dtype=torch.float32))
    losses = train(model, torch.optim.SGD(model.parameters(), lr=0.1))
    return {"losses": losses, "local": [p.detach().clone() for p in model.parameters()],
            "full": full_params(api, model)}


def case_settings(api):
    """set_state_dict_type returns the previous settings; get_state_dict_type reads them; a config of the
    wrong type is refused; the context manager restores what was there."""
    model = api.wrap(mlp())
    first = api.FSDP.set_state_dict_type(model, StateDictType.SHARDED_STATE_DICT)
    now = api.FSDP.get_state_dict_type(model)
    with api.FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, FullStateDictConfig(rank0_only=True)):
        inside = api.FSDP.get_state_dict_type(model)
    after = api.FSDP.get_state_dict_type(model)
    wrong = error_of(lambda: api.FSDP.set_state_dict_type(model, StateDictType.FULL_STATE_DICT,
                                                          ShardedStateDictConfig()))

    def show(s):
        return (s.state_dict_type, type(s.state_dict_config).__name__, type(s.optim_state_dict_config).__name__,
                getattr(s.state_dict_config, "rank0_only", None))

    return {"first": show(first), "now": show(now), "inside": show(inside), "after": show(after), "wrong": wrong}
