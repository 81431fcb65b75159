"""Rank functions for tests/test_fsdp_regimes_torch.py: three regimes, each run on torch FSDP1 and on ours.

Every case is torch-FSDP1 user code through :class:`Side` (``tests/_workers_torch_api.py``): torch's
``FullyShardedDataParallel`` or ours, the same models, seeds and data, torch's enums and wrap policies on
both sides (as a torch user passes them).  Nothing here reads FSDP's internals, so the cases survive a
rewrite of either side:

* the order of collectives in each step, recorded from the c10d ops each side issued
  (``tests/_workers_overlap.CollectiveLog``), every unit named by its padded flat size (the models'
  units all differ in size);
* ``requires_grad`` changed after wrapping, both ways;
* ``load_state_dict`` of incomplete and over-full dicts, strict and not.

:func:`all_regimes` runs all three in one spawn; a regime that raises (on every rank alike) reports its
error and the others still run.
"""

from __future__ import annotations

import re
import traceback

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import BackwardPrefetch, MixedPrecision, ShardingStrategy, StateDictType
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

from minifsdp.fuzz.record import CollectiveRecorder
from tests._workers_overlap import CollectiveLog
from tests._workers_torch_api import Side
from tests._workers_torch_api_more import _PlainRoot

STEPS = 3
SIDES = ("torch", "ours")


class _Unit(nn.Linear):
    """A Linear that the wrap policy makes its own unit (a plain ``nn.Linear`` stays in its parent's)."""


class _Block(nn.Module):
    """A unit with a parameter of its own (``fc``) and a nested unit inside (``inner``)."""

    def __init__(self):
        super().__init__()
        self.fc, self.inner = nn.Linear(13, 11), _Unit(11, 7)

    def forward(self, x):
        return self.inner(torch.relu(self.fc(x)))


class _NormBlock(nn.Module):
    """A unit with a Linear of its own and a BatchNorm that a MixedPrecision run wraps in a unit of its own inside
    it (both FSDPs: ``MixedPrecision._module_classes_to_ignore``)."""

    def __init__(self, d_in: int, d_out: int):
        super().__init__()
        self.fc, self.norm = nn.Linear(d_in, d_out), nn.BatchNorm1d(d_out)

    def forward(self, x):
        return torch.relu(self.norm(self.fc(x)))


class _Spare(nn.Module):
    """A unit whose only gradient path is a frozen Linear (``fc``, frozen before wrapping); ``spare`` (trainable)
    never runs.  With use_orig_params, torch's views of a frozen original are not detached: its gradient reaches
    the flat parameter, and the unit reduce-scatters."""

    def __init__(self):
        super().__init__()
        self.fc, self.spare = nn.Linear(5, 13), nn.Linear(13, 5)

    def forward(self, x):
        return torch.relu(self.fc(x))


class _CalledTwice(nn.Module):
    """Linear units, the first called again after the others: a forward prefetch from its second call must not
    gather the unit after it again (its forward is done)."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c, self.d = nn.Linear(5, 5), nn.Linear(5, 13), nn.Linear(13, 5), nn.Linear(5, 3)

    def forward(self, x):
        return self.d(torch.relu(self.a(torch.relu(self.c(torch.relu(self.b(torch.relu(self.a(x)))))))))


# shape -> (builder, wrap policy); flat sizes at 2 ranks (padded): linears 78, 154, 36 (root none);
# root_params 78, 154 and the root 36; nested: root 102 (5x13 + 7x3 Linears), block 154, inner 84;
# norm_blocks (under MixedPrecision, each BatchNorm a unit inside its block): 78, 26, 154, 22 and the root 36;
# called_twice: 30 (called twice), 78, 70, 18 (root none); spare (use_orig_params): 158 and the root 44
SHAPES = {
    "linears": (lambda: nn.Sequential(nn.Linear(5, 13), nn.ReLU(), nn.Linear(13, 11), nn.ReLU(), nn.Linear(11, 3)),
                lambda: ModuleWrapPolicy({nn.Linear})),
    "root_params": (lambda: nn.Sequential(_Unit(5, 13), nn.ReLU(), _Unit(13, 11), nn.ReLU(), nn.Linear(11, 3)),
                    lambda: ModuleWrapPolicy({_Unit})),
    "nested": (lambda: nn.Sequential(nn.Linear(5, 13), nn.ReLU(), _Block(), nn.ReLU(), nn.Linear(7, 3)),
               lambda: ModuleWrapPolicy({_Block, _Unit})),
    "norm_blocks": (lambda: nn.Sequential(_NormBlock(5, 13), _NormBlock(13, 11), nn.Linear(11, 3)),
                    lambda: ModuleWrapPolicy({_NormBlock})),
    "called_twice": (_CalledTwice, lambda: ModuleWrapPolicy({nn.Linear})),
    "spare": (lambda: nn.Sequential(_Spare(), nn.Linear(13, 3)), lambda: ModuleWrapPolicy({_Spare})),
}


def build(api: Side, shape: str, seed: int = 0, freeze=None, **kwargs):
    """``shape``'s model from ``seed``, ``freeze(model)`` applied before wrapping, wrapped by ``api``'s FSDP."""
    make, policy = SHAPES[shape]
    torch.manual_seed(seed)
    model = make()
    if freeze is not None:
        freeze(model)
    return api.FSDP(model, auto_wrap_policy=policy(), device_id=torch.device("cpu"), **kwargs)


def batch(step: int, rank: int):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(4, 5, generator=g), torch.randn(4, 3, generator=g)


def full_params(api: Side, model) -> list:
    with api.FSDP.summon_full_params(model):
        return [(n, p.detach().clone()) for n, p in model.named_parameters()]


def _grads(model) -> list:
    return [(n, None if p.grad is None else p.grad.detach().clone()) for n, p in model.named_parameters()]


# ---------------------------------------------------------------------- 1. the order of collectives
PREFETCH = {"BACKWARD_PRE": BackwardPrefetch.BACKWARD_PRE, "BACKWARD_POST": BackwardPrefetch.BACKWARD_POST,
            "None": None}
BF16 = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
EXTRAS = {"default": {}, "forward_prefetch": dict(forward_prefetch=True), "no_limit": dict(limit_all_gathers=False),
          "bf16": dict(mixed_precision=BF16),
          "bf16_forward_prefetch": dict(mixed_precision=BF16, forward_prefetch=True),
          "forward_prefetch_two_forwards": dict(forward_prefetch=True),  # (the model runs twice before each backward)
          "frozen_first": {}, "frozen_first_orig": dict(use_orig_params=True),  # (the first Linear frozen)
          "summon_with_grads": dict(use_orig_params=True),  # (summon_full_params(with_grads=True) after the backward)
          "frozen_fc_orig": dict(use_orig_params=True),  # (_Spare's fc frozen)
          # (before each step's forward: a forward under no_grad, then summon_full_params with an edit written back)
          "summon_edit_after_no_grad": dict(use_orig_params=True),
          "summon_edit_not_written_back": dict(use_orig_params=True)}  # (the same with writeback=False)
ORDER_CASES = [(shape, strategy, prefetch, extra) for shape in ("linears", "root_params", "nested")
               for strategy in ("FULL_SHARD", "SHARD_GRAD_OP") for prefetch in PREFETCH
               for extra in ("default", "forward_prefetch", "no_limit")
               if extra != "no_limit" or strategy == "FULL_SHARD"]  # SHARD_GRAD_OP gathers nothing in the backward
# a unit with parameters of its own around a nested one, twice: a pre-backward finds two units gathered
ORDER_CASES += [("norm_blocks", "FULL_SHARD", "BACKWARD_PRE", extra) for extra in ("bf16", "bf16_forward_prefetch")]
# the second forward's prefetch makes views of units that still await the first forward's backward
ORDER_CASES += [("linears", "FULL_SHARD", "BACKWARD_PRE", "forward_prefetch_two_forwards")]
# a unit called twice in one forward: its second call's forward prefetch finds the next unit's forward done
ORDER_CASES += [("called_twice", "FULL_SHARD", "BACKWARD_PRE", "forward_prefetch")]
# a unit the backward never reaches (frozen, its input needs no gradient): SHARD_GRAD_OP keeps what its forward
# gathered into the next step (with use_orig_params, whose forward kept its full views, it is freed), as torch's
ORDER_CASES += [("linears", "SHARD_GRAD_OP", "BACKWARD_PRE", extra) for extra in ("frozen_first", "frozen_first_orig")]
# summon_full_params(with_grads=True): unit by unit, its parameters, the count of ranks without a gradient, the gradient
ORDER_CASES += [("root_params", "FULL_SHARD", "BACKWARD_PRE", "summon_with_grads")]
# a unit the backward reaches only through a frozen original (use_orig_params): it reduce-scatters, as torch's
ORDER_CASES += [("spare", "FULL_SHARD", "BACKWARD_PRE", "frozen_fc_orig")]
# SHARD_GRAD_OP keeps what a no_grad forward gathered; an edit inside summon_full_params is written back to the
# shard and is in the kept buffer too: the next forward gathers nothing, as torch's
ORDER_CASES += [("linears", "SHARD_GRAD_OP", "BACKWARD_PRE", "summon_edit_after_no_grad")]
# the same with writeback=False: the shard never sees the edit, but the kept buffer holds it and the next forward
# computes with it, gathering nothing (torch's _unshard_fsdp_state_params frees only what it gathered)
ORDER_CASES += [("linears", "SHARD_GRAD_OP", "BACKWARD_PRE", "summon_edit_not_written_back")]
ORDER_STEPS = 3  # the 2nd step is the first with an order recorded (forward_prefetch follows it), the 3rd repeats it


def case_order(api: Side, shape: str, strategy: str, prefetch: str, extra: str) -> dict:
    """``ORDER_STEPS`` SGD steps; per step, the (kind, numel) of every all-gather and reduce-scatter in the forward
    (or the two forwards) and in the backward, in the order this rank issued them; the losses and the full
    parameters after."""
    freeze = (lambda m: _first_linear(m).requires_grad_(False)) if extra.startswith("frozen") else None
    model = build(api, shape, freeze=freeze, sharding_strategy=ShardingStrategy[strategy],
                  backward_prefetch=PREFETCH[prefetch], **EXTRAS[extra])
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    out = {"forward": [], "backward": [], "losses": []}
    for step in range(ORDER_STEPS):
        x, y = batch(step, dist.get_rank())
        if extra.startswith("summon_edit"):
            with torch.no_grad():
                model(x)
            with api.FSDP.summon_full_params(model, writeback=extra == "summon_edit_after_no_grad"), torch.no_grad():
                next(iter(model.parameters())).add_(0.5)
        with CollectiveLog() as fwd:
            loss = F.mse_loss(model(x).float(), y)  # (bf16 under MixedPrecision)
            if extra.endswith("two_forwards"):
                loss = loss + F.mse_loss(model(2 * x), y)
        with CollectiveLog() as bwd:
            loss.backward()
        if extra == "summon_with_grads":  # every kind of collective, with its dtype (the count is an int32)
            with CollectiveRecorder() as summon, api.FSDP.summon_full_params(model, with_grads=True):
                pass
            out.setdefault("summon", []).append(summon.log)
        opt.step()
        opt.zero_grad()
        out["forward"].append(fwd.sized())
        out["backward"].append(bwd.sized())
        out["losses"].append(loss.detach())
    out["full"] = full_params(api, model)
    return out


# ---------------------------------------------------------------------- 2. requires_grad changed after wrapping
def _first_linear(model) -> nn.Module:
    return next(m for m in model.modules() if isinstance(m, nn.Linear))


def _set_trainable(api: Side, model, trainable: bool, orig: bool) -> None:
    """What a fine-tuning script does: ``requires_grad_`` on the first Linear's parameters (its weight only with
    use_orig_params=True: a unit may mix frozen and trainable originals then; without it, on its whole unit)."""
    if orig:
        _first_linear(model).weight.requires_grad_(trainable)
    else:
        next(m for m in model.modules() if isinstance(m, api.FSDP) and m is not model).requires_grad_(trainable)


REQUIRES_GRAD_CASES = [(shape, orig, how) for shape in ("linears", "root_params") for orig in (False, True)
                       for how in ("unfreeze", "freeze")]


def case_requires_grad(api: Side, shape: str, orig: bool, how: str) -> dict:
    """``unfreeze``: the first Linear (its weight with use_orig_params) frozen before wrapping, unfrozen after step
    0; ``freeze``: trainable at wrap, frozen after step 0.  SGD with momentum and weight decay over every
    parameter from the start (a parameter whose gradient is zeros rather than None would still move).  Per step:
    the loss, every gradient, the reduce-scatters (kind, numel) of the backward, the full parameters."""
    def freeze(model):
        lin = _first_linear(model)
        for p in ([lin.weight] if orig else lin.parameters()):
            p.requires_grad_(False)

    model = build(api, shape, use_orig_params=orig, freeze=freeze if how == "unfreeze" else None)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.1)
    out = {"losses": [], "grads": [], "reductions": [], "full": [], "requires_grad": []}
    for step in range(STEPS):
        if step == 1:
            _set_trainable(api, model, how == "unfreeze", orig)
        out["requires_grad"].append([(n, p.requires_grad) for n, p in model.named_parameters()])
        x, y = batch(step, dist.get_rank())
        loss = F.mse_loss(model(x), y)
        with CollectiveLog() as log:
            loss.backward()
        out["reductions"].append([e for e in log.sized() if e[0] == "reduce-scatter"])
        out["grads"].append(_grads(model))
        opt.step()
        opt.zero_grad()
        out["losses"].append(loss.detach())
        out["full"].append(full_params(api, model))
    return out


# ---------------------------------------------------------------------- 3. load_state_dict of wrong dicts
class _FSDPRoot(nn.Module):
    """The FSDP-root counterpart of ``_PlainRoot``'s layers: two Linear units, a plain Linear and a BatchNorm
    in the root unit."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(_Unit(5, 13), nn.ReLU(), _Unit(13, 3))
        self.plain = nn.Linear(3, 3)
        self.norm = nn.BatchNorm1d(3)

    def forward(self, x):
        return self.norm(self.plain(self.body(x)))


def _load_model(api: Side, root: str, seed: int, orig: bool):
    if root == "plain":
        return _PlainRoot(api, seed, orig)
    torch.manual_seed(seed)
    return api.FSDP(_FSDPRoot(), auto_wrap_policy=ModuleWrapPolicy({_Unit}), use_orig_params=orig,
                    device_id=torch.device("cpu"))


def _train_one_step(model) -> None:
    x, y = batch(0, dist.get_rank())
    F.mse_loss(model(x), y).backward()
    torch.optim.SGD(model.parameters(), lr=0.1).step()


def _wrong(sd: dict, how: str) -> dict:
    """``sd`` without its first parameter or a buffer (incomplete), with two keys no module has (over-full), both."""
    keys = list(sd)
    out = dict(sd)
    if how in ("missing_param", "both"):
        del out[keys[0]]
    if how == "missing_buffer":
        del out[next(k for k in keys if k.endswith("running_mean"))]
    if how in ("extra", "both"):
        out["junk"] = torch.zeros(3)
        out[keys[0].rsplit(".", 1)[0] + ".junk"] = torch.zeros(3)
    return out


def _quoted(message: str) -> list[str]:
    """The keys a load error names (quoted, in torch's message and ours), sorted."""
    return sorted(set(re.findall(r"[\"']([\w.]+)[\"']", message)))


LOAD_CASES = [(root, kind, orig) for root in ("fsdp", "plain") for kind, orig in
              [("FULL_STATE_DICT", False), ("FULL_STATE_DICT", True), ("SHARDED_STATE_DICT", False),
               ("SHARDED_STATE_DICT", True), ("LOCAL_STATE_DICT", False)]]
WRONG = ("missing_param", "missing_buffer", "extra", "both")


def case_load(api: Side, root: str, kind: str, orig: bool) -> dict:
    """The state dict of a model trained one step, each way wrong, loaded into a model built from another seed:
    strictly (the error's type and the keys it names; then the full parameters, whatever the load left), and not
    (the missing and unexpected keys returned; then the full parameters), and whether the load left the target's
    parameters untouched."""
    sdt = getattr(StateDictType, kind)
    source = _load_model(api, root, 0, orig)
    _train_one_step(source)
    with api.FSDP.state_dict_type(source, sdt):
        sd = source.state_dict()
    out = {}
    for how in WRONG:
        res = {}
        for strict in (True, False):
            target = _load_model(api, root, 1, orig)
            before = full_params(api, target)
            with api.FSDP.state_dict_type(target, sdt):
                try:
                    got = target.load_state_dict(_wrong(sd, how), strict=strict)
                    res[strict] = ("returned", list(got.missing_keys), list(got.unexpected_keys))
                except Exception as e:  # noqa: BLE001 - the error is the result
                    res[strict] = ("raised", type(e).__name__, _quoted(str(e)))
            res[f"full_after_{strict}"] = after = full_params(api, target)
            res[f"untouched_{strict}"] = all(torch.equal(a, b) for (_, a), (_, b) in zip(before, after, strict=True))
        out[how] = res
    return out


# ---------------------------------------------------------------------- all three, one spawn
REGIMES = {"order": (case_order, ORDER_CASES), "requires_grad": (case_requires_grad, REQUIRES_GRAD_CASES),
           "load": (case_load, LOAD_CASES)}


def all_regimes(names=tuple(REGIMES), only=None) -> dict:
    """``{regime: {case: {"torch": ..., "ours": ...}}}``; a case that raises gives ``{"error": traceback}``
    for that side (every rank raises alike in these cases, so the next one still meets the others).
    ``only``: the (regime, case) pairs to run (None: all)."""
    out = {}
    for name in names:
        fn, cases = REGIMES[name]
        out[name] = {}
        for case in cases:
            if only is not None and (name, case) not in only:
                continue
            res = {}
            for side in SIDES:
                try:
                    res[side] = fn(Side(side == "ours"), *case)
                except Exception:  # noqa: BLE001 - the error is the result
                    res[side] = {"error": traceback.format_exc()[-1500:]}
            out[name][case] = res
    return out
