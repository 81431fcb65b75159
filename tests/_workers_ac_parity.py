"""Workers for ``tests/test_fsdp_checkpointing_parity.py``: torch's activation checkpointing on FSDP1 units.

Each case is torch user code: build the fuzzer's model (``minifsdp.fuzz.trees``), wrap it with FSDP1 (torch's
class or ours, the same keywords), then apply torch's own ``apply_activation_checkpointing`` with a reentrant or
non-reentrant ``checkpoint_wrapper`` to every ``Block``, as torch documents for FSDP1 (``minifsdp.fuzz.sides``),
and train a few SGD steps.  A run records, per step, the collectives of the forward and of the backward
(``CollectiveRecorder``: kind, numel, dtype, in issue order), the loss, every gradient (None where there is none)
and every parameter after the step.  ``all_cases`` runs each case on torch and on ours in one spawn.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import BackwardPrefetch, MixedPrecision, ShardingStrategy, StateDictType
from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

import minifsdp
from minifsdp.fuzz.record import CollectiveRecorder, tensors_of
from minifsdp.fuzz.sides import checkpoint_blocks
from minifsdp.fuzz.trees import Block, batch, build_model, loss_of

STEPS = 2

_BASE = {"batch": 6, "container": "sequential", "d": 6, "d_in": 3, "d_out": 5, "frozen": [], "input": "dense",
         "out": "tensor", "repeat": None, "tie": False, "vocab": 13}
# three blocks; the root keeps blocks.0 when only blocks.1 and blocks.2 are units
THREE = dict(_BASE, blocks=[{"kind": "norm", "hidden": 5, "ret": "tuple"},
                            {"kind": "mlp", "hidden": 5, "ret": "tensor"},
                            {"kind": "linear", "hidden": 5, "ret": "tuple"}])
# blocks.1 holds a Block of its own: auto-wrapped, a unit inside a checkpointed block
NESTED = dict(_BASE, blocks=[{"kind": "norm", "hidden": 5, "ret": "tuple"},
                             {"kind": "nested", "hidden": 3, "ret": "tuple",
                              "children": [{"kind": "mlp", "hidden": 5, "ret": "tensor"}]},
                             {"kind": "linear", "hidden": 5, "ret": "tuple"}])
TWICE = dict(THREE, repeat=1)  # blocks.1 runs again after blocks.2: a unit called twice
ONE = dict(_BASE, blocks=[{"kind": "linear", "hidden": 3, "ret": "tensor"}])  # the fuzzer's seed 25, shrunk
# the fuzzer's seed 25 as drawn: a frozen block, dict-subclass outputs (no gradient through them under
# reentrant checkpointing: torch.utils.checkpoint's own limit, the same on both), a nested block
SEED25 = {"batch": 6, "container": "moduledict", "d": 6, "d_in": 3, "d_out": 5, "frozen": ["blocks.b2.fc"],
          "input": "dense", "out": "dict_subclass", "repeat": None, "tie": False, "vocab": 13,
          "blocks": [{"hidden": 6, "kind": "norm", "ret": "tensor"}, {"hidden": 3, "kind": "linear", "ret": "tuple"},
                     {"hidden": 6, "kind": "twice", "ret": "dict_subclass"},
                     {"hidden": 3, "kind": "nested", "ret": "dict_subclass",
                      "children": [{"hidden": 6, "kind": "conv", "ret": "tuple"}]}]}
# the fuzzer's seed 100510: two norm blocks and a block using its Linear twice; blocks.b0 runs again at the end
SEED100510 = dict(_BASE, container="moduledict", d=7, d_out=3, repeat=0,
                  blocks=[{"kind": "norm", "hidden": 3, "ret": "tensor"},
                          {"kind": "norm", "hidden": 3, "ret": "tensor"},
                          {"kind": "twice", "hidden": 3, "ret": "namedtuple"}])
ROOT_KEEPS_BLOCK0 = ("blocks.1", "blocks.2")


def _case(model, ac, strategy="FULL_SHARD", orig=True, units=None, **more) -> dict:
    """``units``: the paths wrapped by hand (None: ``ModuleWrapPolicy({Block})``; "Linear": every Linear a unit)."""
    return dict(model=model, ac=ac, strategy=strategy, orig=orig, units=units, **more)


_STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD")
_PREFETCH = {"FULL_SHARD": dict(forward_prefetch=True), "SHARD_GRAD_OP": dict(backward_prefetch="BACKWARD_POST"),
             "NO_SHARD": {}}

CASES_2 = {
    # reentrant: the root keeps a checkpointed block; FULL_SHARD with forward_prefetch, SHARD_GRAD_OP BACKWARD_POST
    **{f"reentrant-{s}-orig{int(o)}": _case(THREE, "reentrant", s, o, ROOT_KEEPS_BLOCK0, **_PREFETCH[s])
       for s in _STRATEGIES for o in (True, False)},
    "reentrant-auto-wrapped-orig1": _case(THREE, "reentrant"),
    # non-reentrant: a unit inside a checkpointed block runs its forward again inside its own backward
    **{f"non_reentrant-nested-{s}-orig{int(o)}": _case(NESTED, "non_reentrant", s, o) for s in _STRATEGIES
       for o in (True, False)},
    "non_reentrant-root-keeps-a-block-orig1": _case(THREE, "non_reentrant", units=ROOT_KEEPS_BLOCK0),
    # every Linear a unit (the fuzzer's seed 100091): the head's pre-backward prefetches the checkpointed block's
    # unit, whose recompute then runs before its own pre-backward, on the views that prefetch made
    **{f"{a}-linear-units-orig{int(o)}": _case(ONE, a, orig=o, units="Linear")
       for a in ("non_reentrant", "reentrant") for o in (True, False)},
    # the same with forward_prefetch (the fuzzer's seed 100349): the checkpointed unit's forward, under no_grad,
    # prefetches the head, whose views must still carry autograd's graph, or the head gets no gradient
    **{f"reentrant-linear-units-forward-prefetch-orig{int(o)}": _case(ONE, "reentrant", orig=o, units="Linear",
                                                                      forward_prefetch=True) for o in (True, False)},
    # NO_SHARD (the fuzzer's seed 100510): the prefetch gathers nothing but still makes the next unit's views, so
    # the head's all-reduce comes after the checkpointed blocks' recomputed ones, as torch's
    "reentrant-linear-units-forward-prefetch-NO_SHARD-orig0": _case(SEED100510, "reentrant", "NO_SHARD", False,
                                                                     units="Linear", forward_prefetch=True),
    # a unit called twice: non-reentrant (and reentrant where torch gets it right: NO_SHARD without orig params)
    **{f"non_reentrant-twice-{s}-orig{int(o)}": _case(TWICE, "non_reentrant", s, o)
       for s in ("FULL_SHARD", "NO_SHARD") for o in (True, False)},
    "reentrant-twice-NO_SHARD-orig0": _case(TWICE, "reentrant", "NO_SHARD", False),
    # MixedPrecision(param_dtype=bf16)
    **{f"bf16-{a}-{s}-orig{int(o)}": _case(THREE, a, s, o, ROOT_KEEPS_BLOCK0, bf16=True)
       for a in ("reentrant", "non_reentrant") for s in ("FULL_SHARD", "NO_SHARD") for o in (True, False)},
    "bf16-reentrant-SHARD_GRAD_OP-orig1": _case(THREE, "reentrant", "SHARD_GRAD_OP", True, ROOT_KEEPS_BLOCK0,
                                                bf16=True),
    # the state dicts of a checkpointed model: torch's names (no checkpoint wrapper's prefix), saved and loaded
    "state_dicts-reentrant-orig0": _case(THREE, "reentrant", orig=False, units=ROOT_KEEPS_BLOCK0, state_dicts=True),
    "state_dicts-non_reentrant-orig1": _case(NESTED, "non_reentrant", state_dicts=True),
    # world size 1 (each rank on a group of its own): torch FSDP1 and ours turn it into NO_SHARD
    "one_rank-reentrant-orig1": _case(ONE, "reentrant", one_rank=True),
    "one_rank-reentrant-orig0": _case(ONE, "reentrant", orig=False, one_rank=True),
    "one_rank-non_reentrant-orig1": _case(ONE, "non_reentrant", one_rank=True),
    "one_rank-bf16-reentrant-orig1": _case(THREE, "reentrant", units=ROOT_KEEPS_BLOCK0, one_rank=True, bf16=True),
}

CASES_3 = {
    "seed25": _case(SEED25, "reentrant", units=("blocks.b1", "blocks.b2", "blocks.b3"), forward_prefetch=True,
                    seed=25),
    **{f"reentrant-{s}-orig{int(o)}": _case(THREE, "reentrant", s, o, ROOT_KEEPS_BLOCK0) for s in _STRATEGIES
       for o in (True, False)},
    "non_reentrant-nested-FULL_SHARD-orig1": _case(NESTED, "non_reentrant"),
}

# A unit called twice under reentrant checkpointing, where torch FSDP1 is wrong: each against torch without
# checkpointing (``ac=None``), the oracle for ours
PINNED = {
    "twice-reentrant-FULL_SHARD-orig0": _case(TWICE, "reentrant", "FULL_SHARD", False),
    "twice-reentrant-bf16-FULL_SHARD-orig1": _case(TWICE, "reentrant", "FULL_SHARD", True, bf16=True),
    "twice-reentrant-NO_SHARD-orig1": _case(TWICE, "reentrant", "NO_SHARD", True),
}


def _wrap(FSDP, model, case: dict, group):
    kw = dict(sharding_strategy=ShardingStrategy[case["strategy"]], use_orig_params=case["orig"],
              forward_prefetch=case.get("forward_prefetch", False),
              backward_prefetch=BackwardPrefetch[case.get("backward_prefetch", "BACKWARD_PRE")],
              device_id=torch.device("cpu"), process_group=group)
    if case.get("bf16"):
        kw["mixed_precision"] = MixedPrecision(param_dtype=torch.bfloat16)
    if case["units"] in (None, "Linear"):
        return FSDP(model, auto_wrap_policy=ModuleWrapPolicy({nn.Linear} if case["units"] else {Block}), **kw)
    for path in case["units"]:
        parent, _, name = path.rpartition(".")
        model.get_submodule(parent)._modules[name] = FSDP(model.get_submodule(path), **kw)
    return FSDP(model, **kw)


def _state_dicts(FSDP, model, opt, orig: bool) -> dict:
    """Each state dict type's dict as the fuzzer reads it (``tensors_of``), loaded back (missing and unexpected
    keys), and the optimizer state dict, loaded back.  (LOCAL with use_orig_params: torch cannot load its own.)"""
    out = {}
    for kind in ("FULL", "SHARDED") + (() if orig else ("LOCAL",)):
        with FSDP.state_dict_type(model, StateDictType[f"{kind}_STATE_DICT"]):
            sd = model.state_dict()
            loaded = model.load_state_dict(sd)
        out[kind] = (tensors_of(sd), sorted(loaded.missing_keys), sorted(loaded.unexpected_keys))
    osd = FSDP.optim_state_dict(model, opt)
    opt.load_state_dict(FSDP.optim_state_dict_to_load(model, opt, osd))
    out["optim"] = tensors_of(osd)
    return out


def run(FSDP, case: dict, group=None) -> dict:
    """One side: the case's steps, or ``{"error": (type, first line)}``; with ``state_dicts``, the state dicts
    after the steps, and one more step after loading them back."""
    try:
        spec = case["model"]
        model = _wrap(FSDP, build_model(spec, seed=case.get("seed", 7)), case, group)
        if case["ac"]:  # torch's recipe for FSDP1: wrap, then checkpoint the blocks inside the units
            checkpoint_blocks(model, case["ac"])
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        rec, steps, states = CollectiveRecorder(), [], None
        for step in range(STEPS + bool(case.get("state_dicts"))):
            if step == STEPS:
                states = _state_dicts(FSDP, model, opt, case["orig"])
            x, y = batch(spec, step, dist.get_rank())
            with rec:
                out = model(x)
                forward = rec.take()
                loss = loss_of(out, y)
                loss.backward()
                backward = rec.take()
            grads = [(n, None if p.grad is None else p.grad.detach().clone()) for n, p in model.named_parameters()]
            opt.step()
            opt.zero_grad(set_to_none=True)
            steps.append(dict(forward=forward, backward=backward, loss=loss.detach().clone(), grads=grads,
                              params=[(n, p.detach().clone()) for n, p in model.named_parameters()]))
        return {"steps": steps, "states": states}
    except Exception as e:  # noqa: BLE001 - a side's failure is a result (compared, or pinned)
        return {"error": (type(e).__name__, str(e).splitlines()[0] if str(e) else "")}


def all_cases(names: list[str], pinned: list[str]) -> dict:
    """{name: {"torch": ..., "ours": ...}} for the cases of this world size, and for each pinned case also
    ``"torch_plain"``: torch without checkpointing."""
    world = dist.get_world_size()
    own = [dist.new_group([r]) for r in range(world)][dist.get_rank()]  # every rank creates every group
    cases = {**CASES_2, **PINNED} if world == 2 else CASES_3
    out = {}
    for name in names + pinned:
        case = cases[name]
        group = own if case.get("one_rank") else None
        out[name] = {"torch": run(TorchFSDP, case, group), "ours": run(minifsdp.FSDP, case, group)}
        if name in pinned:
            out[name]["torch_plain"] = run(TorchFSDP, dict(case, ac=None), group)
    return out
