"""Rank functions for ``tests/test_mixed_precision_parity.py``: MixedPrecision's gradients and buffers, ours and
torch FSDP1 side by side, in one spawn of 4 ranks (world sizes 1, 2 and 3 on groups of its ranks).

Every case builds the same small model on both sides (the same seed, the same data per rank), runs the same
program, and records what the test compares bitwise: each unit's flat gradient after every backward (its dtype
and its numbers), the flat shards after every optimizer step; for the buffer cases, the buffers of every state
dict type and of the module itself.  Numbers travel as fp32 (an exact widening of bf16 and fp16), their dtype
beside them.
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.distributed as dist
import torch.distributed.fsdp as torch_fsdp
import torch.nn as nn
from torch.distributed.fsdp import StateDictType
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy as torch_policy

import minifsdp
from minifsdp.fsdp import FSDP, ShardingStrategy
from minifsdp.fsdp.core.wrap import transformer_auto_wrap_policy
from tests._workers_fsdp import groups_for

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, None: None}


class Sub(nn.Module):
    """A Linear and a float buffer it scales by (values bf16 cannot hold), a long buffer that counts calls."""

    def __init__(self, n_in: int, n_out: int):
        super().__init__()
        self.lin = nn.Linear(n_in, n_out)
        self.register_buffer("scale", 1.0 + torch.rand(n_out) / 3)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        self.calls += 1
        return torch.tanh(self.lin(x)) * self.scale.to(x.dtype)


class Net(nn.Module):
    """Three wrapped ``Sub`` s (odd flat sizes: padded at 2, 3 and 4 ranks) and a root that keeps a Linear (a
    ``Sub`` of its own, wrapped, with ``bare_root``) and a buffer of its own."""

    def __init__(self, bare_root: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.mid, self.side = Sub(6, 13), Sub(13, 11), Sub(11, 11)
        self.head = Sub(11, 5) if bare_root else nn.Linear(11, 5)
        self.register_buffer("shift", torch.randn(5))

    def forward(self, x):
        h = self.side(self.mid(self.inp(x)))
        return self.head(h.to(self.head.weight.dtype if isinstance(self.head, nn.Linear) else h.dtype)).float() \
            + self.shift.float()


def _data(i: int):
    g = torch.Generator().manual_seed(1000 * dist.get_rank() + i)
    return torch.randn(4, 6, generator=g), torch.randn(4, 5, generator=g)


def _mp(api, spec: tuple):
    param, reduce, buffer, keep = spec
    return api.MixedPrecision(param_dtype=DTYPES[param], reduce_dtype=DTYPES[reduce], buffer_dtype=DTYPES[buffer],
                              keep_low_precision_grads=keep)


class _Side:
    """torch FSDP1's names, or ours."""

    def __init__(self, ours: bool):
        self.ours = ours
        self.FSDP = FSDP if ours else torch_fsdp.FullyShardedDataParallel
        self.MixedPrecision = minifsdp.MixedPrecision if ours else torch_fsdp.MixedPrecision

    def wrap(self, model, group, strategy: str, mp, **kw):
        """``group``: the ranks this case runs on (HYBRID_SHARD: all, as a 2 x 2 mesh)."""
        ours_groups, torch_groups = groups_for(getattr(ShardingStrategy, strategy))
        ours_groups, torch_groups = (ours_groups, torch_groups) if ours_groups else ({"process_group": group},) * 2
        policy = functools.partial(transformer_auto_wrap_policy if self.ours else torch_policy,
                                   transformer_layer_cls={Sub})
        extra = ours_groups if self.ours else dict(torch_groups, device_id=torch.device("cpu"))
        strategy = getattr(ShardingStrategy if self.ours else torch_fsdp.ShardingStrategy, strategy)
        return self.FSDP(model, sharding_strategy=strategy, mixed_precision=mp, auto_wrap_policy=policy, **extra, **kw)


def _tensor(t):
    return None if t is None else (str(t.dtype), tuple(t.shape), t.detach().float().clone())


def _flat_grads(api, model) -> list:
    return [_tensor(u._flat_param.grad) for u in api.FSDP.fsdp_modules(model) if u._flat_param is not None]


def _flat_shards(api, model) -> list:
    return [_tensor(u._flat_param) for u in api.FSDP.fsdp_modules(model) if u._flat_param is not None]


# ---------------------------------------------------------------------- 1, 2. gradients over several backwards
def run_accumulation(api, group, strategy: str, spec: tuple, program: str, orig: bool = False) -> dict:
    """``program``: ``s`` a synced backward, ``n`` one inside ``no_sync()``, ``S`` ``opt.step()``, ``Z``
    ``opt.zero_grad()``; each backward on its own micro-batch.  Records the flat gradients after each backward and
    the flat shards after each step."""
    model = api.wrap(Net(), group, strategy, _mp(api, spec), **({"use_orig_params": True} if orig else {}))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, foreach=False)
    rec = {"grads": [], "shards": [], "losses": []}
    for i, op in enumerate(program):
        if op in "sn":
            x, y = _data(i)
            with model.no_sync() if op == "n" else contextlib.nullcontext():
                loss = (model(x) - y).pow(2).mean()
                loss.backward()
            rec["losses"].append(loss.item())
            rec["grads"].append([_tensor(p.grad) for p in model.parameters()] if orig else _flat_grads(api, model))
        elif op == "S":
            opt.step()
            rec["shards"].append([_tensor(p) for p in model.parameters()] if orig else _flat_shards(api, model))
        elif op == "Z":
            opt.zero_grad()
    return rec


# ---------------------------------------------------------------------- 3. buffers
def _buffers_of(named) -> dict:
    return {n.replace("_fsdp_wrapped_module.", ""): _tensor(b) for n, b in named}


_BUFFER_NAMES = {n for n, _ in Net().named_buffers()}


def _buffer_entries(sd) -> dict:
    """The buffer entries of a state dict (keys of the plain model's buffers)."""
    return {k: _tensor(v) for k, v in sd.items() if k in _BUFFER_NAMES}


def run_buffers(api, group, strategy: str, spec: tuple, sd_type: str, when: str, ignored: str | None,
                bare_root: bool = False) -> dict:
    """Wrap (``ignored``: ``side`` through ``ignored_modules`` or ``ignored_states``), take ``sd_type``'s state dict
    ``when``: ``before`` the first forward, ``after`` one step, or after a FULL state dict was ``load`` ed before the
    first forward; record its buffers and the module's (at wrap, after the load, the step, the state dict)."""
    model = Net(bare_root)
    kw = {} if ignored is None else {ignored: [model.side]}
    model = api.wrap(model, group, strategy, _mp(api, spec), **kw)
    out = {"module_at_wrap": _buffers_of(model.named_buffers())}
    if when == "load":  # a FULL state dict loaded before the first forward (its buffers other numbers)
        plain = Net(bare_root).state_dict()
        plain.update((k, v + 0.1) for k, v in plain.items() if v.is_floating_point() and k in _BUFFER_NAMES)
        with api.FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT):
            model.load_state_dict(plain)
        out["module_after_load"] = _buffers_of(model.named_buffers())
    if when == "after":
        x, y = _data(0)
        (model(x) - y).pow(2).mean().backward()
        out["module_after_forward"] = _buffers_of(model.named_buffers())
    with api.FSDP.state_dict_type(model, getattr(StateDictType, sd_type)):
        sd = model.state_dict()
    out["state_dict"] = _buffer_entries(sd)
    out["module_after_state_dict"] = _buffers_of(model.named_buffers())
    if when in ("before", "load"):  # and the forward after it computes with what the state dict left
        x, y = _data(0)
        out["loss"] = (model(x) - y).pow(2).mean().item()
        out["module_after_forward"] = _buffers_of(model.named_buffers())
    return out


# ---------------------------------------------------------------------- the spawn
def _both(fn, group, *args) -> dict:
    out = {}
    for side in ("ours", "torch"):
        try:
            out[side] = fn(_Side(side == "ours"), group, *args)
        except Exception as e:  # noqa: BLE001 - reported to the test, which names it
            out[side] = {"error": f"{type(e).__name__}: {e}"}
    return out


def all_cases(plan: list) -> dict:
    """``plan``: ``(ranks, cases)`` pairs, each case ``(kind, *args)`` with kind ``accumulation`` or ``buffers``, run
    on a group of those ranks (world sizes 1, 2, 3 and 4 in one spawn of 4: ranks outside a group go on to their
    next).  Returns this rank's ``{case: {"ours": ..., "torch": ...}}``."""
    fns = {"accumulation": run_accumulation, "buffers": run_buffers}
    groups = [dist.new_group(list(ranks)) for ranks, _ in plan]  # every rank creates every group, in one order
    out = {}
    for (ranks, cases), group in zip(plan, groups, strict=True):
        if dist.get_rank() in ranks:
            out.update((case, _both(fns[case[0]], group, *case[1:])) for case in cases)
    return out
