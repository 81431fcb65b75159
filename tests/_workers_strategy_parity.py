"""Rank functions for tests/test_fsdp_strategy_parity.py: strategies and regimes, torch's FSDP beside ours.

Every case runs torch-FSDP1 (or ``fully_shard``) user code on torch and on ours, the same model, seed and data,
in one 4-rank spawn (:func:`all_cases`).  Nothing is written down from torch: its flat sizes, collectives,
groups, warnings, errors and numbers are recorded here in the same run.

    case              what runs                                                  ranks
    flat_sizes        NO_SHARD + use_orig_params (fp32 and bf16): each unit's     groups of 2, 3 and 4
                      flat size, the backward's collectives, 2 steps
    hybrid            HYBRID_SHARD / _HYBRID_SHARD_ZERO2 with an auto_wrap_policy  4 (no groups given); 2 x 2
                      and no groups (torch builds them); on a 2 x 2 device_mesh;  (mesh)
                      without a policy (torch's error)
    clip_below        clip_grad_norm_ with the total norm below max_norm         4
    dropped_forward   bf16 param_dtype, a grad-enabled forward never             4
                      backpropagated, then a step
    tied_no_sync      NO_SHARD + use_orig_params + bf16, a tied weight, no_sync   2 (ranks 0, 1)
    hsdp_mp           fully_shard on a (2, 2) mesh, bf16 and fp16 param and       2 x 2
                      reduce dtypes, 3 steps

A case that raises on one side reports ``{"error": (type, message)}`` for that side (every rank raises alike),
so the next case still meets the other ranks.
"""

from __future__ import annotations

import time
import traceback
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMPPolicy
from torch.distributed.fsdp import ShardingStrategy
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.fsdp.wrap import ModuleWrapPolicy
from torch.utils._python_dispatch import TorchDispatchMode

from minifsdp.fsdp2 import MixedPrecisionPolicy, fully_shard
from tests._workers_torch_api import Side

SIDES = ("torch", "ours")
CPU = torch.device("cpu")


def mlp(seed: int = 0) -> nn.Sequential:
    """Linear(5, 13), Linear(13, 11), Linear(11, 3): 78, 154 and 36 numbers, none a multiple of 2, 3 or 4 once
    aligned (81, 155, 39)."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 13), nn.ReLU(), nn.Linear(13, 11), nn.ReLU(), nn.Linear(11, 3))


def batch(step: int, rank: int):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(4, 5, generator=g), torch.randn(4, 3, generator=g)


def loss_of(model, step: int) -> torch.Tensor:
    x, y = batch(step, dist.get_rank())
    return F.mse_loss(model(x).float(), y)


def full_params(api: Side, model) -> list:
    with api.FSDP.summon_full_params(model):
        return [(n, p.detach().clone()) for n, p in model.named_parameters()]


def grads(model) -> list:
    return [(n, None if p.grad is None else p.grad.detach().clone()) for n, p in model.named_parameters()]


_KINDS = {"allreduce_": "all-reduce", "allgather_": "all-gather", "_allgather_base_": "all-gather",
          "_reduce_scatter_base_": "reduce-scatter"}


class C10dLog(TorchDispatchMode):
    """Every collective issued inside, as (kind, numel of its first argument: an all-reduce's tensor, an
    all-gather's output, a reduce-scatter's output): torch's FSDP and ours alike.  torch FSDP1 on the CPU gathers
    into a list of chunks (``allgather_``), ours into one tensor (``_allgather_base_``): both are "all-gather"."""

    def __init__(self):
        super().__init__()
        self.ops: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "c10d" and func._opname in _KINDS:
            first = args[0] if isinstance(args[0], (list, tuple)) else [args[0]]
            flat = [t for x in first for t in (x if isinstance(x, (list, tuple)) else [x])]
            self.ops.append((_KINDS[func._opname], sum(t.numel() for t in flat)))
        return func(*args, **(kwargs or {}))


def _error(e: Exception) -> dict:
    return {"error": (type(e).__name__, str(e)), "trace": traceback.format_exc()[-1500:]}


def _warnings_of(fn):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = fn()
    return out, sorted({str(w.message) for w in caught if "deprecated" not in str(w.message)})


def _replicas_equal(t: torch.Tensor) -> bool:
    """The same bits on every rank (MIN and MAX over the world agree)."""
    lo, hi = t.clone(), t.clone()
    dist.all_reduce(lo, op=dist.ReduceOp.MIN)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    return torch.equal(lo, hi)


def _train(api: Side, model, steps: int = 2) -> dict:
    """SGD with momentum; per step the loss, the gradients and the backward's collectives; the full parameters."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    out = {"losses": [], "grads": [], "collectives": []}
    for step in range(steps):
        loss = loss_of(model, step)
        with C10dLog() as log:
            loss.backward()
        out["grads"].append(grads(model))
        out["collectives"].append(log.ops)
        opt.step()
        opt.zero_grad()
        out["losses"].append(loss.detach())
    out["full"] = full_params(api, model)
    return out


# ---------------------------------------------------------------------- 1. NO_SHARD + use_orig_params: padding
FLAT_GROUP_SIZES = (2, 3, 4)
FLAT_DTYPES = {"fp32": None, "bf16": torch.bfloat16}


def case_flat_sizes() -> dict:
    """For each group size k (ranks 0..k-1; the others wait) and param dtype: each unit's flat parameter numel,
    then 2 steps.  torch aligns each original to 16 bytes and pads the end to a multiple of k, NO_SHARD too."""
    groups = {k: dist.new_group(list(range(k))) for k in FLAT_GROUP_SIZES}  # every rank creates every group
    out = {}
    for k, group in groups.items():
        if dist.get_rank() >= k:
            continue
        for name, dtype in FLAT_DTYPES.items():
            res = {}
            for side in SIDES:
                api = Side(side == "ours")
                mp = api.MixedPrecision(param_dtype=dtype) if dtype is not None else None
                try:
                    model = api.FSDP(mlp(), process_group=group, sharding_strategy=ShardingStrategy.NO_SHARD,
                                     auto_wrap_policy=ModuleWrapPolicy({nn.Linear}), use_orig_params=True,
                                     mixed_precision=mp, device_id=CPU)
                    res[side] = {"numels": [u._flat_param.numel() for u in api.FSDP.fsdp_modules(model)
                                            if u._flat_param is not None], **_train(api, model)}
                except Exception as e:  # noqa: BLE001 - the error is the result
                    res[side] = _error(e)
            out[(k, name)] = res
    return out


# ---------------------------------------------------------------------- 2. HYBRID_SHARD given no groups
HYBRID = ("HYBRID_SHARD", "_HYBRID_SHARD_ZERO2")


def _groups_of(api: Side, model) -> list:
    """Per unit: (its strategy's name, the ranks of its shard group, of its replicate group)."""
    out = []
    for u in api.FSDP.fsdp_modules(model):
        shard, replicate = (u.groups.shard, u.groups.replicate) if api.ours else (u.process_group, u._inter_node_pg)
        out.append((u.sharding_strategy.name, dist.get_process_group_ranks(shard),
                    dist.get_process_group_ranks(replicate)))
    return out


def case_hybrid() -> dict:
    """Per strategy, with ``ModuleWrapPolicy({nn.Linear})`` and neither ``process_group`` nor ``device_mesh``:
    the groups each side built, the warnings, 2 steps, whether the replicas stay equal; torch's NO_SHARD over all
    ranks beside it.  The same on a (2, 2) ``device_mesh``; and without a policy, each side's error."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    out = {}
    for strategy in HYBRID:
        res = {}
        for side in SIDES:
            api = Side(side == "ours")
            try:
                model, warned = _warnings_of(lambda a=api, s=strategy: a.FSDP(
                    mlp(), sharding_strategy=ShardingStrategy[s], device_id=CPU,
                    auto_wrap_policy=ModuleWrapPolicy({nn.Linear})))
                res[side] = {"groups": _groups_of(api, model), "warnings": warned, **_train(api, model)}
                res[side]["replicas_equal"] = _replicas_equal(torch.cat([p.reshape(-1) for _, p in
                                                                         res[side]["full"]]))
            except Exception as e:  # noqa: BLE001 - the error is the result
                res[side] = _error(e)
            try:
                api.FSDP(mlp(), sharding_strategy=ShardingStrategy[strategy], device_id=CPU)
                res[side]["manual_wrap"] = None
            except Exception as e:  # noqa: BLE001 - the error is the result
                res[side]["manual_wrap"] = (type(e).__name__, str(e))
            model = api.FSDP(mlp(), sharding_strategy=ShardingStrategy[strategy], device_id=CPU, device_mesh=mesh,
                             auto_wrap_policy=ModuleWrapPolicy({nn.Linear}))
            res[side]["mesh"] = {"groups": _groups_of(api, model), **_train(api, model)}
        api = Side(False)
        res["torch_no_shard"] = _train(api, api.FSDP(mlp(), sharding_strategy=ShardingStrategy.NO_SHARD,
                                                     device_id=CPU, auto_wrap_policy=ModuleWrapPolicy({nn.Linear})))
        out[strategy] = res
    return out


# ---------------------------------------------------------------------- 3a. clip_grad_norm_ below max_norm
CLIP_CASES = {"FULL_SHARD": dict(sharding_strategy=ShardingStrategy.FULL_SHARD),
              "FULL_SHARD+orig": dict(sharding_strategy=ShardingStrategy.FULL_SHARD, use_orig_params=True),
              "NO_SHARD": dict(sharding_strategy=ShardingStrategy.NO_SHARD)}
MAX_NORM = 1e3  # far above the total norm (about 1)


class _Multiplies(TorchDispatchMode):
    """How many multiplications run inside (``mul``, ``mul_``, ``_foreach_mul_``, any overload)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += "mul" in func.overloadpacket.__name__
        return func(*args, **(kwargs or {}))


def case_clip_below() -> dict:
    """One backward, then ``model.clip_grad_norm_(MAX_NORM)``: the gradients before and after, the norm returned,
    and how many multiplications the clip ran."""
    out = {}
    for name, kwargs in CLIP_CASES.items():
        res = {}
        for side in SIDES:
            api = Side(side == "ours")
            model = api.FSDP(mlp(), auto_wrap_policy=ModuleWrapPolicy({nn.Linear}), device_id=CPU, **kwargs)
            loss_of(model, 0).backward()
            before = grads(model)
            with _Multiplies() as muls:
                norm = model.clip_grad_norm_(MAX_NORM)
            res[side] = {"before": before, "after": grads(model), "norm": norm, "multiplies": muls.count}
        out[name] = res
    return out


# ---------------------------------------------------------------------- 4a. a dropped forward under bf16 param_dtype
DROPPED_CASES = {"FULL_SHARD": dict(sharding_strategy=ShardingStrategy.FULL_SHARD,
                                    auto_wrap_policy=ModuleWrapPolicy({nn.Linear})),
                 "NO_SHARD": dict(sharding_strategy=ShardingStrategy.NO_SHARD)}


def case_dropped_forward() -> dict:
    """Step 0; then (``dropped``) a forward with autograd on whose output is never backpropagated (a check, a
    metric); then step 1's backward: its gradients and collectives.  Each side with and without the dropped one."""
    out = {}
    for name, kwargs in DROPPED_CASES.items():
        res = {}
        for side in SIDES:
            api = Side(side == "ours")
            for dropped in (False, True):
                model = api.FSDP(mlp(), mixed_precision=api.MixedPrecision(param_dtype=torch.bfloat16),
                                 device_id=CPU, **kwargs)
                opt = torch.optim.SGD(model.parameters(), lr=0.1)
                loss_of(model, 0).backward()
                opt.step()
                opt.zero_grad()
                if dropped:
                    model(batch(7, dist.get_rank())[0])  # the output is dropped at once
                loss = loss_of(model, 1)
                with C10dLog() as log:
                    loss.backward()
                res[(side, dropped)] = {"grads": grads(model), "collectives": log.ops}
        out[name] = res
    return out


# ---------------------------------------------------------------------- 4b. a tied weight under no_sync
class TiedLM(nn.Module):
    """An embedding and an output head sharing one weight (7 x 4), a Linear between."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.mid, self.head = nn.Embedding(7, 4), nn.Linear(4, 4), nn.Linear(4, 7, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx):
        return self.head(torch.relu(self.mid(self.emb(idx))))


def case_tied_no_sync() -> dict:
    """NO_SHARD over ranks 0 and 1 (the others wait), bf16 param_dtype, 2 steps of (a micro-batch under
    ``no_sync()``, then a synced one): each side with use_orig_params True and False; the losses and the full
    parameters after.  Why 2 ranks?  use_orig_params lays the flat parameter out otherwise (aligned), and gloo
    sums 3 or more ranks' bf16 gradients in an order that depends on the buffer's size; 2 ranks' sum is one
    addition, whatever the order: the layouts then compare bitwise."""
    pair, out = dist.new_group([0, 1]), {}
    if dist.get_rank() > 1:
        return out
    for side in SIDES:
        api = Side(side == "ours")
        for orig in (True, False):
            try:
                model = api.FSDP(TiedLM(), pair, sharding_strategy=ShardingStrategy.NO_SHARD, use_orig_params=orig,
                                 mixed_precision=api.MixedPrecision(param_dtype=torch.bfloat16), device_id=CPU)
                opt = torch.optim.SGD(model.parameters(), lr=0.1)
                g, losses = torch.Generator().manual_seed(dist.get_rank()), []
                for _ in range(2):
                    idx = torch.randint(0, 7, (6,), generator=g)
                    with model.no_sync():
                        F.cross_entropy(model(idx).float(), idx).backward()
                    loss = F.cross_entropy(model(idx).float(), idx)
                    loss.backward()
                    opt.step()
                    opt.zero_grad()
                    losses.append(loss.detach())
                out[(side, orig)] = {"losses": losses, "full": full_params(api, model)}
            except Exception as e:  # noqa: BLE001 - the error is the result
                out[(side, orig)] = _error(e)
    return out


# ---------------------------------------------------------------------- 3b. fully_shard on a 2-D mesh, mixed precision
HSDP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
HSDP_STEPS = 3


def case_hsdp_mp() -> dict:
    """``fully_shard`` on each Linear, then the root, on a (replicate 2, shard 2) mesh, param and reduce dtype
    both bf16 (or fp16); AdamW, 3 steps: per step the loss, each parameter's local gradient and local shard."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    out = {}
    for name, dtype in HSDP_DTYPES.items():
        res = {}
        for side in SIDES:
            model = mlp()
            if side == "ours":
                shard, mp = fully_shard, MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=dtype)
            else:
                shard, mp = torch_fully_shard, TorchMPPolicy(param_dtype=dtype, reduce_dtype=dtype)
            for layer in model:
                if isinstance(layer, nn.Linear):
                    shard(layer, mesh=mesh, mp_policy=mp)
            shard(model, mesh=mesh, mp_policy=mp)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
            r = {"losses": [], "grads": [], "params": []}
            for step in range(HSDP_STEPS):
                loss = loss_of(model, step)
                loss.backward()
                r["grads"].append([(n, p.grad.to_local().clone()) for n, p in model.named_parameters()])
                opt.step()
                opt.zero_grad()
                r["losses"].append(loss.detach())
                r["params"].append([(n, p.to_local().detach().clone()) for n, p in model.named_parameters()])
            res[side] = r
        out[name] = res
    return out


CASES = {"flat_sizes": case_flat_sizes, "hybrid": case_hybrid, "clip_below": case_clip_below,
         "dropped_forward": case_dropped_forward, "tied_no_sync": case_tied_no_sync, "hsdp_mp": case_hsdp_mp}


def all_cases(names=tuple(CASES)) -> dict:
    """``{case: result}`` for each named case, in one spawn (and ``seconds``: each case's time); a case that
    raises reports its traceback."""
    out = {"seconds": {}}
    for name in names:
        start = time.perf_counter()
        try:
            out[name] = CASES[name]()
        except Exception:  # noqa: BLE001 - the error is the result
            out[name] = {"case_error": traceback.format_exc()[-3000:]}
        dist.barrier()
        out["seconds"][name] = time.perf_counter() - start
    return out
