"""Chapter 6's pitfalls, each run on torch's FSDP and on ours in the same ranks: the facts its cells and tests read.

A pitfall is a program a user wrote (an optimizer built too early, a load after a forward, ...).  Each function
below runs one on this rank, once with torch's FSDP1 or FSDP2 and once with ours, and returns small picklable
facts: losses, norms, whether the replicas agree, the error or warnings each side gave::

    minifsdp.spawn(run_pitfalls, args=(["clip", "hybrid"],), world_size=2)
    -> [{"clip": {"torch": [...], "ours": [...], "plain": ...}, "hybrid": {...}},   rank 0
        {...}]                                                                     rank 1

``tests/test_pitfalls.py`` holds ours to torch with these facts; the chapter 6 explorer
(``minifsdp/explorers/pitfall_pair.py``) prints them side by side.  Every function is the reproduction the
chapter's section describes, at the world size it is given (2 in the chapter; the mesh of ``hybrid`` is N x 1).
"""

from __future__ import annotations

import functools
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP
from torch.distributed.fsdp import ShardingStrategy as TorchStrategy
from torch.distributed.fsdp import StateDictType
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy as torch_size_policy

from minifsdp.fsdp import FSDP, ShardingStrategy
from minifsdp.fsdp.torch_options import size_based_auto_wrap_policy
from minifsdp.fsdp2 import MixedPrecisionPolicy, fully_shard
from minifsdp.models import MLP

__all__ = ["CPU", "PITFALLS", "error_of", "warnings_of", "optimizer_cases", "load_cases", "hybrid_cases", "clip_cases",
           "frozen_cases", "small_tensor_cases", "torch_dcp_cases", "run_pitfalls"]


def error_of(fn):
    """(exception type, message) of what ``fn()`` raised, or None if it returned."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the caller reads the type and the message
        return type(e).__name__, str(e)
    return None


CPU = {"device_id": torch.device("cpu")}  # torch FSDP1 on a machine without an accelerator


def warnings_of(fn):
    """(fn's result, the messages of the warnings it raised)."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        out = fn()
    return out, [str(w.message) for w in seen]


def _batch(rank: int, world: int):
    return MLP().batch(0, 4, rank, world)


def _loss(model, x, y):
    return (model(x) - y).square().mean()


def _losses_around_a_step(model, opt, x, y) -> tuple[float, float]:
    """One SGD step: the loss before and after it (equal: the step trained nothing)."""
    before = _loss(model, x, y)
    before.backward()
    opt.step()
    opt.zero_grad()
    with torch.no_grad():
        return before.item(), _loss(model, x, y).item()


# ------------------------------------------------------------------ an optimizer built at the wrong time
def optimizer_cases(rank: int, world: int, mesh) -> dict:
    x, y = _batch(rank, world)
    out = {}
    sgd = functools.partial(torch.optim.SGD, lr=0.5)

    def fsdp2(shard, when: str):
        m = MLP()
        opt = sgd(m.parameters()) if when == "before" else None
        shard(m.net[0])  # the first layer on its own; the root takes the rest (its group stays unsharded
        shard(m)  # from a forward to its backward)
        if when != "before" and when != "after":
            with torch.no_grad() if when == "after_no_grad_forward" else torch.enable_grad():
                m(x)  # a check of the freshly sharded model (differentiable by mistake, but for the first)
            if when == "after_reshard":
                m.reshard()
        opt = opt or sgd(m.parameters())
        return _losses_around_a_step(m, opt, x, y)

    theirs = functools.partial(torch_fully_shard, mesh=mesh)
    for when in ("before", "after_forward", "after_no_grad_forward", "after_reshard", "after"):
        out[f"torch_fsdp2_{when}"] = fsdp2(theirs, when)
        out[f"ours_fsdp2_{when}"] = error_of(lambda w=when: fsdp2(fully_shard, w))
        if out[f"ours_fsdp2_{when}"] is None:
            out[f"ours_fsdp2_{when}"] = ("trained", fsdp2(fully_shard, when))
    m = MLP()
    opt = sgd(m.parameters())
    out["torch_fsdp1_before"] = _losses_around_a_step(TorchFSDP(m, **CPU), opt, x, y)
    return out


# ------------------------------------------------------------------ load_state_dict between forward and backward
def load_cases(rank: int, world: int) -> dict:
    """Load another model's weights after a forward that no backward followed (a check of the freshly wrapped
    model), then run a forward: FULL and LOCAL state dicts, torch's and ours; then the same after a no_grad
    forward.  Each: (output unchanged from before the load, output = the loaded model's)."""
    x, _ = _batch(rank, world)
    wanted = MLP(seed=1)(x)  # what a forward must give once the weights are loaded
    out = {}

    def run(cls, kind, differentiated: bool, **kw):
        src = cls(MLP(seed=1), **kw)
        with cls.state_dict_type(src, kind):
            checkpoint = src.state_dict()
        m = cls(MLP(seed=0), **kw)
        with torch.enable_grad() if differentiated else torch.no_grad():
            first = m(x)
        with cls.state_dict_type(m, kind):
            m.load_state_dict(checkpoint)
        with torch.no_grad():
            second = m(x)
        return torch.equal(second, first), torch.equal(second, wanted), second

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch: state_dict_type is deprecated for DCP's API
        for kind in (StateDictType.FULL_STATE_DICT, StateDictType.LOCAL_STATE_DICT):
            name = kind.name.split("_")[0].lower()
            out[f"torch_{name}_awaiting"] = run(TorchFSDP, kind, True, **CPU)[:2]
            out[f"ours_{name}_awaiting"] = error_of(lambda k=kind: run(FSDP, k, True))
            theirs, ours = run(TorchFSDP, kind, False, **CPU), warnings_of(lambda k=kind: run(FSDP, k, False))
            out[f"torch_{name}_no_grad"], out[f"ours_{name}_no_grad"] = theirs[:2], ours[0][:2]
            out[f"ours_{name}_no_grad_bitwise_torch"] = torch.equal(ours[0][2], theirs[2])
            out[f"ours_{name}_no_grad_warnings"] = ours[1]
    return out


# ------------------------------------------------------------------ HYBRID_SHARD over a shard group of 1
def hybrid_cases(rank: int, world: int) -> dict:
    x, y = _batch(rank, world)
    mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("replicate", "shard"))
    out = {}

    def run(cls, strategy, **kw):
        def make():
            m = cls(MLP(), sharding_strategy=strategy, **kw)
            _losses_around_a_step(m, torch.optim.SGD(m.parameters(), lr=0.5), x, y)
            with cls.summon_full_params(m):
                return torch.cat([p.detach().reshape(-1) for p in m.parameters()])
        return warnings_of(make)

    def replicas_equal(t: torch.Tensor) -> bool:
        lo, hi = t.clone(), t.clone()
        dist.all_reduce(lo, op=dist.ReduceOp.MIN)
        dist.all_reduce(hi, op=dist.ReduceOp.MAX)
        return torch.equal(lo, hi)

    theirs, their_warnings = run(TorchFSDP, TorchStrategy.HYBRID_SHARD, device_mesh=mesh, **CPU)
    ours, our_warnings = run(FSDP, ShardingStrategy.HYBRID_SHARD, device_mesh=mesh)
    no_shard, _ = run(TorchFSDP, TorchStrategy.NO_SHARD, **CPU)  # the fix, on torch: one group of all ranks
    full, full_warnings = run(FSDP, ShardingStrategy.FULL_SHARD)
    out["torch_replicas_equal"], out["torch_warnings"] = replicas_equal(theirs), their_warnings
    out["ours_replicas_equal"], out["ours_warnings"] = replicas_equal(ours), our_warnings
    out["ours_bitwise_torch_no_shard"] = torch.equal(ours, no_shard)
    out["full_shard_warnings"] = full_warnings
    return out


# ------------------------------------------------------------------ torch.nn.utils.clip_grad_norm_ on flat shards
def clip_cases(rank: int, world: int) -> dict:
    x, y = _batch(rank, world)
    policy = functools.partial(size_based_auto_wrap_policy, min_num_params=500)
    their_policy = functools.partial(torch_size_policy, min_num_params=500)
    out = {}
    for name, wrap in (("torch", lambda m: TorchFSDP(m, auto_wrap_policy=their_policy, **CPU)),
                       ("ours", lambda m: FSDP(m, auto_wrap_policy=policy))):
        norms = []
        for fsdp_clip in (False, True):
            m = wrap(MLP())
            _loss(m, x, y).backward()
            norms.append(m.clip_grad_norm_(1e9) if fsdp_clip else
                         torch.nn.utils.clip_grad_norm_(m.parameters(), 1e9))
        out[name] = norms
    plain = MLP()
    xs, ys = zip(*(_batch(r, world) for r in range(world)))
    sum(_loss(plain, a, b) for a, b in zip(xs, ys, strict=True)).div(world).backward()
    out["plain"] = torch.nn.utils.clip_grad_norm_(plain.parameters(), 1e9)
    return out


# ------------------------------------------------------------------ frozen and trainable parameters in one unit
def frozen_cases(rank: int, world: int) -> dict:
    x, y = _batch(rank, world)
    out = {}

    def frozen_first_layer():
        m = MLP()
        m.net[0].requires_grad_(False)
        return m

    for name, cls, kw in (("torch", TorchFSDP, CPU), ("ours", FSDP, {})):
        out[f"{name}_flat"] = error_of(lambda cls=cls, kw=kw: cls(frozen_first_layer(), **kw))
        m = cls(frozen_first_layer(), use_orig_params=True, **kw)
        _loss(m, x, y).backward()
        flat = m._flat_param
        trainable = sum(p.numel() for p in frozen_first_layer().parameters() if p.requires_grad)
        grads = [None if p.grad is None else p.grad.clone() for p in m.parameters()]
        out[f"{name}_orig"] = (flat.grad.numel(), flat.numel(), trainable, flat.grad.clone(), grads)
    return out


# ----------------------------------------------------------- FSDP2's zero gradient at world size 1 (not reproduced)
class VectorMultiply(nn.Module):
    """A learned scale of shape ``shape`` (the report's (1,)), applied as exp(mean)."""

    def __init__(self, shape=(1,)):
        super().__init__()
        self.log_multiplier = nn.Parameter(torch.zeros(shape))

    def forward(self, x):
        return x * torch.exp(self.log_multiplier.mean())


class ScaledLinear(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin, self.scale = nn.Linear(8, 8), VectorMultiply()

    def forward(self, x):
        return self.scale(self.lin(x))


def one_rank_grads(mesh, shard, mp) -> torch.Tensor:
    m = ScaledLinear()
    shard(m.scale, mesh=mesh, mp_policy=mp)  # the small tensor in a sharded submodule, as reported
    shard(m, mesh=mesh, mp_policy=mp)
    (m(torch.ones(4, 8)).sum() * 1000).backward()
    return m.scale.log_multiplier.grad.to_local().clone()


def small_tensor_cases(rank: int, world: int) -> dict:
    groups, _ = dist.new_subgroups(1)  # every rank a world of its own: world size 1, as reported
    mesh = DeviceMesh.from_group(groups, "cpu")
    out = {}
    for label, theirs, ours in (("fp32", TorchMP(), MixedPrecisionPolicy()),
                                ("bf16", TorchMP(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
                                 MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))):
        out[label] = (one_rank_grads(mesh, torch_fully_shard, theirs), one_rank_grads(mesh, fully_shard, ours))
    return out


# ------------------------------------------------------------------ torch's checkpoint API on an FSDP1 model
def _dcp_round_trip(model, opt, options) -> tuple[list, list]:
    """torch's get_state_dict then set_state_dict: the value types and the optimizer state's keys."""
    msd, osd = get_state_dict(model, opt, options=options)
    set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd, options=options)
    return sorted({type(v).__name__ for v in msd.values()}), sorted(osd["state"])


def torch_dcp_cases(rank: int, world: int) -> dict:
    """``torch.distributed.checkpoint.state_dict.get_state_dict`` (sharded and full) and ``set_state_dict`` on torch
    FSDP1 (the value types it returns, or its error) and on ours (the error); and ours' own API still answers."""
    out = {}
    for side, wrap in (("torch", lambda m: TorchFSDP(m, **CPU)), ("ours", FSDP)):
        torch.manual_seed(0)
        model = wrap(MLP())
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        _losses_around_a_step(model, opt, *_batch(rank, world))
        for full in (False, True):
            try:
                out[side, full] = ("returned", *_dcp_round_trip(model, opt, StateDictOptions(full_state_dict=full)))
            except Exception as e:  # noqa: BLE001 - the test reads the type and the message
                out[side, full] = (type(e).__name__, str(e))
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):  # ours' own API: a sharded dict
        out["ours", "own"] = sorted({type(v).__name__ for v in model.state_dict().values()})
    return out


PITFALLS = {  # name -> the function that runs it on this rank (rank, world) -> facts
    "optimizer": lambda rank, world: optimizer_cases(rank, world, init_device_mesh("cpu", (world,))),
    "hybrid": hybrid_cases, "load": load_cases, "clip": clip_cases, "frozen": frozen_cases,
    "dcp": torch_dcp_cases,
}


def run_pitfalls(names: list[str]) -> dict:
    """Rank code: every named pitfall of :data:`PITFALLS` on this rank, in order; {name: its facts}."""
    rank, world = dist.get_rank(), dist.get_world_size()
    return {name: PITFALLS[name](rank, world) for name in names}
