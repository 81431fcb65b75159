"""Rank functions for tests/test_fsdp_outputs.py: forward outputs and the backward's bookkeeping, torch beside ours.

Every case runs the same user code on torch (FSDP1 ``FullyShardedDataParallel``, or FSDP2 ``fully_shard``) and on
ours, in one spawn, from the same seed and data, and records what a user sees: the losses, every gradient after
each backward, the full parameters at the end, the order of the all-gathers and reduce-scatters (c10d ops,
``tests/_workers_overlap.CollectiveLog``, each named by its numel: the units' sizes all differ), the training
states, and what raised.  Nothing here reads either side's internals but ``training_state``.

* ``outputs``: a unit and the root return a dataclass, a dict or an OrderedDict subclass, a namedtuple, a set, nests;
* ``outputs_fsdp2``: the same on FSDP2, and a dataclass field the constructor does not take (``init=False``);
* ``callback``: the backward's final callback where torch's root gets no pre-backward (a loss on an inner output
  kept aside; an output torch does not walk), and after a backward that raised;
* ``twice_order``: a unit called twice in one forward: the collective order in each step;
* ``mp_twice``: the same under ``MixedPrecision(param_dtype=bf16)``, gradients accumulated over backwards;
  ``mp_discard``: a forward whose output gets no backward, then a trained one;
* ``mp_inputs``: a dataclass input cast by the root and by a module class kept in fp32.
"""

from __future__ import annotations

import contextlib
import dataclasses
import traceback
from collections import OrderedDict, namedtuple

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import BackwardPrefetch, MixedPrecision, ShardingStrategy
from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

import minifsdp
from minifsdp.fsdp2 import fully_shard as our_fully_shard
from tests._workers_overlap import CollectiveLog

SIDES = ("torch", "ours")
CPU = torch.device("cpu")


def fsdp(side: str):
    return TorchFSDP if side == "torch" else minifsdp.FullyShardedDataParallel


def batch(step: int, rows: int = 4, cols: int = 5):
    g = torch.Generator().manual_seed(1000 * step + dist.get_rank())
    return torch.randn(rows, cols, generator=g)


def grads(model) -> list:
    return [(n, None if p.grad is None else p.grad.detach().clone()) for n, p in model.named_parameters()]


def full_params(side: str, model) -> list:
    with fsdp(side).summon_full_params(model):
        return [(n, p.detach().clone()) for n, p in model.named_parameters()]


def states(side: str, model) -> list[str]:
    return [u.training_state.name for u in model.modules() if isinstance(u, fsdp(side))]


def error_of(fn) -> str | None:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the error is the result
        return type(e).__name__
    return None


# ---------------------------------------------------------------------- nests a forward returns
@dataclasses.dataclass
class Pair:
    h: torch.Tensor
    aux: torch.Tensor


@dataclasses.dataclass
class LatePair:
    """``aux`` is set after construction: a field ``dataclasses.fields`` lists and the constructor does not take."""
    h: torch.Tensor
    aux: torch.Tensor = dataclasses.field(init=False, default=None)


class Out(dict):
    """A dict subclass."""


class ModelOutput(OrderedDict):
    """An OrderedDict subclass, as Hugging Face models return (``tree_flatten`` knows OrderedDict, not this)."""


NT = namedtuple("NT", "h aux")
KINDS = ("dataclass", "dict_subclass", "ordered_dict", "namedtuple", "set", "nested")
FSDP2_KINDS = KINDS[:4] + ("nested", "late_field")


def pack(kind: str, h, aux):
    if kind == "dataclass":
        return Pair(h, aux)
    if kind == "late_field":
        out = LatePair(h)
        out.aux = aux
        return out
    if kind == "dict_subclass":
        return Out(h=h, aux=aux)
    if kind == "ordered_dict":
        return ModelOutput(h=h, aux=aux)
    if kind == "namedtuple":
        return NT(h, aux)
    if kind == "set":
        return [{h, aux}]
    return [Pair(h, Out(a=(aux,)))]  # nested


def unpack(kind: str, out):
    if kind in ("dataclass", "late_field", "namedtuple"):
        return out.h, out.aux
    if kind in ("dict_subclass", "ordered_dict"):
        return out["h"], out["aux"]
    if kind == "set":
        return tuple(sorted(out[0], key=lambda t: -t.dim()))  # (h: 2-D, aux: 1-D)
    return out[0].h, out[0].aux["a"][0]


class Body(nn.Module):
    """The inner unit: ``h`` from ``fc``, ``aux`` from ``side`` (a path of its own), packed as ``kind``."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind, self.fc, self.side = kind, nn.Linear(5, 7), nn.Linear(5, 1)

    def forward(self, x):
        return pack(self.kind, self.fc(x), self.side(x).squeeze(-1))


class Net(nn.Module):
    """The root: ``head`` on the body's ``h``, packed as ``kind`` again; remembers the types it saw and returned."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind, self.body, self.head = kind, Body(kind), nn.Linear(7, 3)
        self.seen = None

    def forward(self, x):
        inner = self.body(x)
        self.seen = type(inner).__name__
        h, aux = unpack(self.kind, inner)
        return pack(self.kind, self.head(torch.relu(h)), aux)


def _train_outputs(model, kind: str, steps: int = 2, aux_only: bool = False) -> dict:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = {"losses": [], "grads": [], "forward": [], "backward": [], "types": []}
    for step in range(steps):
        with CollectiveLog() as fwd:
            result = model(batch(step))
        h, aux = unpack(kind, result)
        loss = aux.square().mean() if aux_only else h.square().mean() + aux.mean()
        with CollectiveLog() as bwd:
            loss.backward()
        out["grads"].append(grads(model))
        opt.step()
        opt.zero_grad()
        out["losses"].append(loss.detach())
        out["forward"].append(fwd.sized())
        out["backward"].append(bwd.sized())
        out["types"].append((model.module.seen if hasattr(model, "module") else model.seen, type(result).__name__))
    return out


def case_outputs(side: str, kind: str) -> dict:
    torch.manual_seed(0)
    model = fsdp(side)(Net(kind), auto_wrap_policy=ModuleWrapPolicy({Body}), device_id=CPU)
    out = _train_outputs(model, kind)
    out["full"] = full_params(side, model)
    return out


def case_outputs_fsdp2(side: str, kind: str) -> dict:
    """FSDP2: ``aux`` alone makes the loss for ``late_field``, so only the field the constructor does not take
    leads the backward into the body."""
    torch.manual_seed(0)
    model = Net(kind)
    if side == "torch":
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        torch_fully_shard(model.body, mesh=mesh)
        torch_fully_shard(model, mesh=mesh)
    else:
        our_fully_shard(model.body)
        our_fully_shard(model)
    out = _train_outputs(model, kind, aux_only=kind == "late_field")
    out["grads"] = [[(n, None if g is None else g.to_local()) for n, g in step] for step in out["grads"]]
    out["full"] = [(n, p.full_tensor().detach().clone()) for n, p in model.named_parameters()]
    return out


# ---------------------------------------------------------------------- the final callback
class Box:
    """A plain object: neither torch's walk nor ours enters it."""

    def __init__(self, t):
        self.t = t


class CallbackNet(nn.Module):
    """``aside``: the root returns a tensor that needs no gradient and keeps the body's output, which the loss uses;
    ``through``: the same loss, the body's output returned in a tuple (torch's root then gets its pre-backward);
    ``box``: the root returns its output in a :class:`Box`; ``walked``: in a tuple instead."""

    def __init__(self, how: str):
        super().__init__()
        self.how, self.body, self.head = how, Body("namedtuple"), nn.Linear(7, 3)
        self.kept = None

    def forward(self, x):
        h = self.body(x).h
        y = self.head(torch.relu(h))
        if self.how == "aside":
            self.kept = h
            return y.detach()
        if self.how == "through":
            return y.detach(), h
        return Box(y) if self.how == "box" else (y,)


def _callback_loss(model, how: str, out):
    if how == "aside":
        return model.module.kept.square().mean()
    if how == "through":
        return out[1].square().mean()
    return (out.t if how == "box" else out[0]).square().mean()


def case_callback(side: str, how: str) -> dict:
    """Two SGD steps: per step the loss, what the backward raised, the training states and the gradients after it."""
    torch.manual_seed(0)
    model = fsdp(side)(CallbackNet(how), auto_wrap_policy=ModuleWrapPolicy({Body}), device_id=CPU)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = {"losses": [], "raised": [], "states": [], "grads": []}
    for step in range(2):
        loss = _callback_loss(model, how, model(batch(step)))
        out["raised"].append(error_of(loss.backward))
        out["states"].append(states(side, model))
        out["grads"].append(grads(model))
        out["losses"].append(loss.detach())
        if out["raised"][-1] is not None:
            return out  # (torch's state is broken from here)
        opt.step()
        opt.zero_grad()
    out["summon_raised"] = error_of(lambda: full_params(side, model))
    if out["summon_raised"] is None:
        out["full"] = full_params(side, model)
    return out


def _raise(grad):
    raise RuntimeError("a user's hook raised")


def case_died(side: str, clean: bool) -> dict:
    """Step 0's backward raises in a user's hook after the root's pre-backward ran (``clean``: no step 0), then
    steps 1 and 2 train: per step the training states, the gradients; the full parameters at the end."""
    torch.manual_seed(0)
    model = fsdp(side)(CallbackNet("walked"), auto_wrap_policy=ModuleWrapPolicy({Body}), device_id=CPU)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = {"raised": [], "states": [], "grads": []}
    for step in range(1 if clean else 0, 3):
        y = model(batch(step))[0]
        if step == 0:
            y.register_hook(_raise)
        out["raised"].append(error_of(y.square().mean().backward))
        out["states"].append(states(side, model))
        out["grads"].append(grads(model))
        if out["raised"][-1] is None:
            opt.step()
        opt.zero_grad()
    out["full"] = full_params(side, model)
    return out


# ---------------------------------------------------------------------- a unit called twice
class Unit(nn.Linear):
    """A Linear that the wrap policy makes its own unit."""


class ScaledUnit(nn.Module):
    """A unit of 6 -> 6 with one more parameter than a Linear (so its flat size differs from ``a``'s)."""

    def __init__(self):
        super().__init__()
        self.lin, self.scale = nn.Linear(6, 6), nn.Parameter(torch.ones(1))

    def forward(self, x):
        return self.lin(x) * self.scale


class Chain(nn.Module):
    """Units run in the order ``order`` names (a letter twice: a unit called twice); ``head``: the root keeps a
    Linear.  Flat sizes: a 42, b 36 (no bias), c 43, d 21."""

    def __init__(self, order: str, head: bool):
        super().__init__()
        self.order = order
        self.a, self.b, self.c, self.d = Unit(6, 6), Unit(6, 6, bias=False), ScaledUnit(), Unit(6, 3)
        self.head = nn.Linear(3, 3) if head else None

    def forward(self, x):
        for name in self.order:
            x = torch.tanh(getattr(self, name)(x))
        return self.head(x) if self.head is not None else x


TWICE_SHAPES = {"abad": False, "abcbd": True}  # order -> the root keeps a Linear
PREFETCH = {"BACKWARD_PRE": BackwardPrefetch.BACKWARD_PRE, "BACKWARD_POST": BackwardPrefetch.BACKWARD_POST}
TWICE_STEPS = 3


def _wrap_chain(side: str, order: str, **kwargs):
    torch.manual_seed(0)
    return fsdp(side)(Chain(order, TWICE_SHAPES.get(order, False)),
                      auto_wrap_policy=ModuleWrapPolicy({Unit, ScaledUnit}), device_id=CPU, **kwargs)


def case_twice_order(side: str, order: str, prefetch: str) -> dict:
    model = _wrap_chain(side, order, backward_prefetch=PREFETCH[prefetch])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = {"losses": [], "forward": [], "backward": []}
    for step in range(TWICE_STEPS):
        with CollectiveLog() as fwd:
            loss = model(batch(step, cols=6)).square().mean()
        with CollectiveLog() as bwd:
            loss.backward()
        opt.step()
        opt.zero_grad()
        out["losses"].append(loss.detach())
        out["forward"].append(fwd.sized())
        out["backward"].append(bwd.sized())
    out["full"] = full_params(side, model)
    return out


# ---------------------------------------------------------------------- MixedPrecision
MP_CASES = [("NO_SHARD", "plain"), ("FULL_SHARD", "no_sync"), ("SHARD_GRAD_OP", "no_sync"), ("NO_SHARD", "no_sync")]


def case_mp_twice(side: str, strategy: str, accumulate: str) -> dict:
    """``c`` called twice under bf16; three backwards, their gradients accumulated (``no_sync``: the first two
    inside it; ``plain``: no ``zero_grad`` between them), then one SGD step."""
    bf16 = (MixedPrecision if side == "torch" else minifsdp.MixedPrecision)(param_dtype=torch.bfloat16)
    model = _wrap_chain(side, "accd", sharding_strategy=ShardingStrategy[strategy], mixed_precision=bf16)
    out = {"losses": [], "grads": []}
    for step in range(3):
        inside = accumulate == "no_sync" and step < 2
        with model.no_sync() if inside else contextlib.nullcontext():
            loss = model(batch(step, cols=6)).float().square().mean()
            loss.backward()
        out["losses"].append(loss.detach())
        out["grads"].append(grads(model))
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    out["full"] = full_params(side, model)
    return out


def case_mp_discard(side: str, discard: bool) -> dict:
    """Under bf16, FULL_SHARD: each step a forward whose output is dropped (``discard``), then the trained one."""
    bf16 = (MixedPrecision if side == "torch" else minifsdp.MixedPrecision)(param_dtype=torch.bfloat16)
    model = _wrap_chain(side, "acd", mixed_precision=bf16)
    out = {"grads": []}
    for step in range(2):
        if discard:
            model(batch(step, cols=6))
        model(batch(step, cols=6)).float().square().mean().backward()
        out["grads"].append(grads(model))
        for p in model.parameters():
            p.grad = None
    return out


@dataclasses.dataclass
class Feats:
    h: torch.Tensor
    scale: torch.Tensor


class KeptFp32(nn.Module):
    """A module class ``MixedPrecision._module_classes_to_ignore`` names: it runs in fp32, on a dataclass."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(7, 7)

    def forward(self, feats: Feats):
        return self.lin(feats.h) * feats.scale.mean()


class FeatsNet(nn.Module):
    """The root takes a dataclass (cast by the root), hands one to ``keep``; records the dtypes it saw."""

    def __init__(self):
        super().__init__()
        self.body, self.keep, self.head = Body("dataclass"), KeptFp32(), nn.Linear(7, 3)
        self.dtypes = None

    def forward(self, feats: Feats):
        h = self.body(feats.h).h
        y = self.keep(Feats(h, feats.scale))
        self.dtypes = [str(t.dtype) for t in (feats.h, feats.scale, h, y)]
        return self.head(y)


def case_mp_inputs(side: str) -> dict:
    kw = dict(param_dtype=torch.bfloat16, _module_classes_to_ignore=(KeptFp32,))
    mp = MixedPrecision(**kw) if side == "torch" else minifsdp.MixedPrecision(**kw)
    torch.manual_seed(0)
    model = fsdp(side)(FeatsNet(), auto_wrap_policy=ModuleWrapPolicy({Body}), device_id=CPU, mixed_precision=mp)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = {"losses": [], "grads": [], "dtypes": []}
    for step in range(2):
        loss = model(Feats(batch(step), batch(step + 7)[:, :1])).float().square().mean()
        loss.backward()
        out["grads"].append(grads(model))
        opt.step()
        opt.zero_grad()
        out["losses"].append(loss.detach())
        out["dtypes"].append(model.module.dtypes)
    out["full"] = full_params(side, model)
    return out


# ---------------------------------------------------------------------- every case, one spawn
def cases(world: int) -> dict:
    """name -> (function, args) for this world size (3 ranks: the unit called twice, with and without bf16)."""
    out = {("twice_order", shape, p): (case_twice_order, (shape, p)) for shape in TWICE_SHAPES for p in PREFETCH}
    out.update({("mp_twice", s, a): (case_mp_twice, (s, a)) for s, a in MP_CASES})
    if world == 2:
        out.update({("outputs", k): (case_outputs, (k,)) for k in KINDS})
        out.update({("outputs_fsdp2", k): (case_outputs_fsdp2, (k,)) for k in FSDP2_KINDS})
        out.update({("callback", how): (case_callback, (how,)) for how in ("aside", "through", "box", "walked")})
        out.update({("died", clean): (case_died, (clean,)) for clean in (False, True)})
        out.update({("mp_discard", d): (case_mp_discard, (d,)) for d in (False, True)})
        out[("mp_inputs",)] = (case_mp_inputs, ())
    return out


def all_cases(only: tuple = ()) -> dict:
    """Every case of this world size (``only``: those named), on both sides: {case: {side: result or {"error"}}}."""
    results = {}
    for name, (fn, args) in cases(dist.get_world_size()).items():
        if only and name not in only:
            continue
        results[name] = {}
        for side in SIDES:
            try:
                results[name][side] = fn(side, *args)
            except Exception:  # noqa: BLE001 - reported, so the other cases still run
                results[name][side] = {"error": traceback.format_exc(limit=-4)}
    return results
