"""Rank side of the port: torch FSDP1 or ours behind one set of names, the batch runner, shared checks.

A case is ``case(api, **params)``, run on every rank, once with ``api = Side(ours=False)`` (torch's
``FullyShardedDataParallel``) and once with ``Side(ours=True)`` (minifsdp's), on the same seeds.  While
it runs, the module-global ``FSDP`` of ``torch.testing._internal.common_fsdp`` (the name torch's test
models wrap with in their ``init()``) is patched to that side's class, so torch's own models
(TransformerWithSharedParams, NestedWrappedModule, MixtureOfExperts, ...) build with ours.

A case fails by raising.  A case may also return observables (tensors, numbers, nested in lists and
dicts); when it is registered with ``vs_torch=(rtol, atol)``, ours must return what torch returned,
within that tolerance (:func:`same`: tensors by ``assert_close``, dtypes included; the rest by ``==``).

    parent (pytest)                          every rank
    spawn(run_batch, (module, ids)) ----->   for id in ids:  torch side, meet, ours side, meet
                                             (meet: every rank's outcome, through the store: _agree.py)
           <----- {id: {"torch": err|None, "ours": err|None}}
"""

from __future__ import annotations

import contextlib
import importlib
import json
import traceback
import warnings
from dataclasses import dataclass, field
from typing import Callable
from unittest import mock

import torch
import torch.distributed as dist
import torch.distributed.fsdp as tfsdp
import torch.testing._internal.common_fsdp as cf
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler as TorchShardedGradScaler
from torch.nn.parallel import DistributedDataParallel as TorchDDP
from torch.testing._internal.common_fsdp import DEVICEInitMode, FSDPInitMode

import minifsdp
from tests.torch_suite._agree import Meeting, RanksLeftWaiting

CPU = torch.device("cpu")
DEFAULT_MODES = (FSDPInitMode.NO_FSDP, DEVICEInitMode.DEVICE_BEFORE)  # a torch test model without FSDP


class Side:
    """torch FSDP1 (``ours=False``) or minifsdp (``ours=True``); everything else (enums, configs) is torch's,
    as code written for torch passes it."""

    def __init__(self, ours: bool):
        self.ours = ours
        self.name = "ours" if ours else "torch"
        self.FSDP = minifsdp.FullyShardedDataParallel if ours else tfsdp.FullyShardedDataParallel
        self.ShardedGradScaler = minifsdp.ShardedGradScaler if ours else TorchShardedGradScaler

    @contextlib.contextmanager
    def in_place(self):
        """torch's test models wrap with this side's FSDP while the block runs."""
        with mock.patch.object(cf, "FSDP", self.FSDP):
            yield self

    def kwargs(self, **kw) -> dict:
        kw.setdefault("device_id", CPU)  # torch FSDP1 on CPU needs it; ours accepts it
        return kw

    def wrap(self, module, *args, **kw):
        return self.FSDP(module, *args, **self.kwargs(**kw))

    def init(self, model_cls, fsdp_kwargs: dict | None = None, wrap_root: bool = True, group=None, **init_kw):
        """torch's ``model_cls.init(group, RECURSIVE, DEVICE_BEFORE, fsdp_kwargs, deterministic=True)``
        with this side's FSDP, plus a root unit when ``init`` leaves the top unwrapped (as torch's
        parity helper does)."""
        kw = self.kwargs(**(fsdp_kwargs or {}))
        model = model_cls.init(group or dist.group.WORLD, FSDPInitMode.RECURSIVE, DEVICEInitMode.DEVICE_BEFORE,
                               dict(kw), deterministic=True, **init_kw)
        if wrap_root and not isinstance(model, self.FSDP):
            kw.pop("auto_wrap_policy", None)
            model = self.FSDP(model, **kw)
        return model

    def full_params(self, model, **kw) -> list[torch.Tensor]:
        with self.FSDP.summon_full_params(model, **kw):
            return [p.detach().clone() for p in model.parameters()]


class _FSDP1OnCPU(tfsdp.FullyShardedDataParallel):
    """torch FSDP1 with ``device_id`` defaulting to the CPU (a subclass, so torch's isinstance checks hold)."""

    def __init__(self, *args, **kw):
        kw.setdefault("device_id", CPU)
        super().__init__(*args, **kw)


def fsdp1_defaults_to_cpu():
    """torch's side, for MixtureOfExperts: it wraps its inner NestedWrappedModule's layers without the
    caller's kwargs, and FSDP1 on a CPU-only machine refuses to start without ``device_id``."""
    return mock.patch.object(cf, "FSDP", _FSDP1OnCPU)


def local_model(model_cls, **init_kw):
    """torch's model without FSDP (the reference's starting point), same seed as :meth:`Side.init`."""
    return model_cls.init(dist.group.WORLD, FSDPInitMode.NO_FSDP, DEVICEInitMode.DEVICE_BEFORE,
                          deterministic=True, **init_kw)


def zero_params(api: Side, model) -> None:
    with api.FSDP.summon_full_params(model):
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()


def train(model, steps: int, *, lr: float = 0.01, autocast: torch.dtype | None = None, scaler=None,
          save_load: Side | None = None, inputs: Callable | None = None):
    """SGD with momentum (Adam's scale invariance would hide a wrong gradient scale) on the model's own
    ``get_input`` / ``get_loss`` / ``run_backward``; with ``save_load``, each step ends with a state-dict
    round trip through zeroed parameters (a broken save or load then breaks the parity)."""
    inner = model.module
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    loss = None
    for step in range(steps):
        opt.zero_grad()
        inp = inputs(step) if inputs else inner.get_input(CPU)
        with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
            out = model(*inp)
            loss = inner.get_loss(inp, out)
        if scaler is not None:
            loss = scaler.scale(loss)
        inner.run_backward(loss)
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        if save_load is not None:
            sd = {k: v.clone() for k, v in model.state_dict().items()}
            zero_params(save_load, model)
            model.load_state_dict(sd)
    return loss.detach()


def ddp_parity(api: Side, model_cls, fsdp_kwargs: dict, *, steps: int = 2, ref_wrap=None, save_load: bool = True,
               check_params: bool = True, init_kw: dict | None = None, ref_autocast=None, lr: float = 0.01):
    """torch's parity check: the same model trained by torch DDP (or ``ref_wrap``) and by this side's FSDP.

    Oracle: DDP.  Tolerance: assert_close's fp32 defaults (rtol 1.3e-6, atol 1e-5), as torch's test; not
    bitwise, since DDP all-reduces a sum and divides once while FSDP divides around a reduce-scatter."""
    init_kw = init_kw or {}
    ref = (ref_wrap or TorchDDP)(local_model(model_cls, **init_kw))
    ref_loss = train(ref, steps, lr=lr, autocast=ref_autocast)
    ref_params = [p.detach().clone() for p in ref.parameters()]
    model = api.init(model_cls, fsdp_kwargs, **init_kw)
    loss = train(model, steps, lr=lr, save_load=api if save_load else None)
    torch.testing.assert_close(loss, ref_loss, check_dtype=False, msg=lambda m: f"loss vs DDP: {m}")
    if check_params:
        got = api.full_params(model)
        assert len(got) == len(ref_params), f"{len(got)} full parameters vs DDP's {len(ref_params)}"
        for i, (a, b) in enumerate(zip(got, ref_params)):
            torch.testing.assert_close(a, b, msg=lambda m, i=i: f"parameter {i} vs DDP: {m}")
    return model


# ---------------------------------------------------------------- registry and runner
@dataclass
class Case:
    fn: Callable
    params: dict = field(default_factory=dict)
    world: int = 2
    vs_torch: tuple | None = None  # (rtol, atol): ours must return what torch returns


def _short(v) -> str:
    if hasattr(v, "name"):
        return v.name
    if isinstance(v, torch.dtype):
        return str(v).removeprefix("torch.")
    return str(v)


class Cases(dict):
    """``id -> Case``; ids read ``name:key=value,...`` (pytest shows them)."""

    def add(self, fn: Callable, *, world: int = 2, vs_torch=None, **params) -> str:
        name = fn.__name__.removeprefix("case_")
        cid = name + (":" + ",".join(f"{k}={_short(v)}" for k, v in params.items()) if params else "")
        if world != 2:
            cid += f"@{world}"
        assert cid not in self, f"duplicate case {cid}"
        self[cid] = Case(fn, params, world, vs_torch)
        return cid


def same(a, b, rtol: float = 0.0, atol: float = 0.0, what: str = "result") -> None:
    """``a`` equals ``b``: dict keys in order, lengths, tensors by assert_close (dtype and shape included),
    anything else by ``==``."""
    if isinstance(a, dict) and isinstance(b, dict):
        assert list(a) == list(b), f"{what}: keys {list(a)} vs {list(b)}"
        for k in a:
            same(a[k], b[k], rtol, atol, f"{what}[{k!r}]")
    elif isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        assert len(a) == len(b), f"{what}: {len(a)} vs {len(b)} entries"
        for i, (x, y) in enumerate(zip(a, b)):
            same(x, y, rtol, atol, f"{what}[{i}]")
    elif isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")
    else:
        assert a == b, f"{what}: {a!r} vs {b!r}"


def error_of(fn: Callable) -> str | None:
    """The type name of what ``fn()`` raises, or None."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the error is the result
        return type(e).__name__
    return None


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:300]


def _run_side(case: Case, side: Side):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with side.in_place():
            torch.manual_seed(0)
            return case.fn(side, **case.params)


def run_batch(module: str, ids: list[str], sides: tuple = ("torch", "ours"), log: str | None = None) -> dict:
    """On every rank: each case on each side; ``{id: {side: None | "Error: first line"}}``.

    With ``log``, each rank appends a line to ``{log}.{rank}`` as it starts a side and as it finishes a
    case, so that when a rank dies (a crash, a hang) the parent knows what finished and what killed it."""
    cases = importlib.import_module(module).CASES
    path = f"{log}.{dist.get_rank()}" if log else None

    def note(**entry):
        if path:
            with open(path, "a") as f:
                f.write(json.dumps(entry) + "\n")

    out = {}
    meeting = Meeting()  # after each side, instead of a barrier (tests/torch_suite/_agree.py says why)
    try:
        for cid in ids:
            out[cid] = _run_case(cid, cases[cid], sides, note, meeting)
    finally:
        meeting.close()
    return out


def _run_case(cid: str, case: Case, sides: tuple, note: Callable, meeting: Meeting) -> dict:
    res, values = {}, {}
    for name in sides:
        note(start=cid, side=name)
        try:
            values[name] = _run_side(case, Side(name == "ours"))
            res[name] = None
        except Exception as e:  # noqa: BLE001 - the error is the result
            res[name] = _first_line(e)
            res[name + "_tb"] = traceback.format_exc()[-3000:]
        note(ended=cid, side=name, err=res[name])
        try:
            meeting.side_over(cid, name, res[name], res.get(name + "_tb"))
        except RanksLeftWaiting as e:  # this batch is over: the parent blames this case, runs the rest anew
            note(left_waiting=cid, side=name, why=str(e), tb=e.detail)
            raise
    if case.vs_torch and res.get("ours") is None and res.get("torch") is None and "torch" in values:
        try:
            same(values["ours"], values["torch"], *case.vs_torch)
        except Exception as e:  # noqa: BLE001
            res["ours"] = "vs torch's result: " + _first_line(e)
    note(done=cid, res=res)
    return res
