"""Run one fuzz program on one side, on this rank, and write down what a user would see.

    build the model from the seed --> wrap (torch's FSDP or ours) --> the optimizer --> each step:

    train             forward, loss, backward (scaled by the grad scaler if asked), the gradients,
                      clip_grad_norm_ if asked (its total norm), optimizer step, zero_grad, the parameters
    accum             forward, backward, the gradients: no step, so the next backward adds to them
    no_sync           the same inside ``no_sync()`` (FSDP2: ``set_requires_gradient_sync(False)``)
    eval, no_grad     a forward in eval mode / under ``torch.no_grad()`` in train mode: the loss
    state_dict        a state dict of the asked type (FULL, SHARDED, LOCAL), loaded back if asked
    optim_state_dict  ``FSDP.optim_state_dict`` (FSDP1), loaded back through ``optim_state_dict_to_load``
    dcp_state_dict    ``torch.distributed.checkpoint.state_dict.get_state_dict`` (FSDP2), set back if asked
    summon            inside ``summon_full_params`` (writeback, with_grads): the parameters, an edit, after it
    unshard           ``unshard()`` (or ``unshard(async_op=True).wait()``), then ``reshard()``

and at the end the full parameters and the buffers.  Each step also records the collectives it issued
(``record.CollectiveRecorder``) when it trains or runs forward; the state dicts' own traffic (pickled
objects whose size is each side's business) is compared by its result instead.

A step that raises ends the side: the record keeps which step and the exception's type, and the two sides
agree if they raised the same type at the same step.  Every rank runs the same steps on its own data.
"""

from __future__ import annotations

import contextlib
import warnings

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.fsdp import (
    FullOptimStateDictConfig,
    FullStateDictConfig,
    LocalStateDictConfig,
    ShardedStateDictConfig,
    StateDictType,
)

from minifsdp.fuzz.compare import differences
from minifsdp.fuzz.program import Program
from minifsdp.fuzz.record import CollectiveRecorder, error_of, tensors_of, types_of
from minifsdp.fuzz.sides import RankContext, Side, wrap
from minifsdp.fuzz.trees import batch, build_model, loss_of

__all__ = ["run_side", "run_programs"]

_TRAINS = ("train", "accum", "no_sync", "eval", "no_grad", "unshard", "summon")


def _optimizer(spec: dict, model):
    """The optimizer over ``model.parameters()``; with ``groups``, decay and no-decay groups split by name, as
    users split biases and norms out of weight decay."""
    params = list(model.parameters())
    if spec.get("groups"):
        named = list(model.named_parameters())
        params = [{"params": [p for n, p in named if not n.endswith("bias")], "weight_decay": 0.1},
                  {"params": [p for n, p in named if n.endswith("bias")], "weight_decay": 0.0}]
    if spec["name"] == "sgd":
        return torch.optim.SGD(params, lr=spec["lr"], momentum=0.9)
    return (torch.optim.Adam if spec["name"] == "adam" else torch.optim.AdamW)(params, lr=spec["lr"])


def _grads(model) -> list:
    return [(n, None if p.grad is None else tensors_of(p.grad)[0][1:]) for n, p in model.named_parameters()]


def _params(model) -> list:
    return tensors_of(dict(model.named_parameters()))


def _forward_backward(program: Program, side: Side, model, step: int, scaler) -> dict:
    x, y = batch(program.model, step, dist.get_rank())
    loss = loss_of(model(x), y)
    (scaler.scale(loss) if scaler is not None else loss).backward()
    return {"loss": loss.item(), "grads": _grads(model)}


@contextlib.contextmanager
def _no_sync(program: Program, model):
    if program.impl == "fsdp1":
        with model.no_sync():
            yield
    else:
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)


def _clip(program: Program, side: Side, model, max_norm: float, norm_type):
    norm_type = float(norm_type)  # "inf" in a program's JSON
    if program.impl == "fsdp1":
        return model.clip_grad_norm_(max_norm, norm_type)
    return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, norm_type)


def _config(step: dict):
    if step["type"] == "FULL":
        return StateDictType.FULL_STATE_DICT, FullStateDictConfig(offload_to_cpu=step["offload"],
                                                                  rank0_only=step["rank0_only"])
    if step["type"] == "SHARDED":
        return StateDictType.SHARDED_STATE_DICT, ShardedStateDictConfig(offload_to_cpu=step["offload"])
    return StateDictType.LOCAL_STATE_DICT, LocalStateDictConfig(offload_to_cpu=step["offload"])


def _state_dict(program: Program, side: Side, model, step: dict) -> dict:
    if program.impl == "fsdp2":
        sd = model.state_dict()
        out = {"state": tensors_of(sd), "state_types": types_of(sd)}
        if step["load"]:
            model.load_state_dict(sd)
        return out
    kind, cfg = _config(step)
    with side.FSDP.state_dict_type(model, kind, cfg):
        sd = model.state_dict()
    out = {"state": tensors_of(sd), "state_types": types_of(sd)}
    if step["load"] and not (step["type"] == "FULL" and step["rank0_only"]):
        with side.FSDP.state_dict_type(model, kind, cfg):
            result = model.load_state_dict(sd)
        out["load"] = (sorted(result.missing_keys), sorted(result.unexpected_keys))
    return out


def _optim_state_dict(program: Program, side: Side, model, opt, step: dict) -> dict:
    if step["rank0_only"]:
        with side.FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, FullStateDictConfig(rank0_only=True),
                                       FullOptimStateDictConfig(rank0_only=True)):
            osd = side.FSDP.optim_state_dict(model, opt)
    else:
        osd = side.FSDP.optim_state_dict(model, opt)
    out = {"optim": tensors_of(osd)}
    if step["load"] and not step["rank0_only"]:
        opt.load_state_dict(side.FSDP.optim_state_dict_to_load(model, opt, osd))
    return out


def _dcp_state_dict(model, opt, step: dict) -> dict:
    """``get_state_dict`` of ``torch.distributed.checkpoint.state_dict`` (FSDP2's checkpoint API), then
    ``set_state_dict`` back if asked."""
    options = StateDictOptions(full_state_dict=step["full"], cpu_offload=step["offload"])
    msd, osd = get_state_dict(model, opt, options=options)
    out = {"state": tensors_of(msd), "state_types": types_of(msd), "optim": tensors_of(osd)}
    if step["load"] and not (step["full"] and step["offload"]):  # full + offload: only rank 0 holds it
        set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd, options=options)
    return out


def _step(program: Program, side: Side, model, opt, scaler, i: int, step: dict) -> dict:
    op = step["op"]
    if op == "train":
        out = _forward_backward(program, side, model, i, scaler)
        if step["clip"] is not None:
            if scaler is not None:
                scaler.unscale_(opt)
            out["total_norm"] = tensors_of(_clip(program, side, model, step["clip"], step.get("norm_type", 2.0)))
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
            out["scale"] = float(scaler.get_scale())
        else:
            opt.step()
        opt.zero_grad(set_to_none=step["set_to_none"])
        out["params"] = _params(model)
        return out
    if op == "accum":
        return _forward_backward(program, side, model, i, scaler)
    if op == "no_sync":
        with _no_sync(program, model):
            return _forward_backward(program, side, model, i, scaler)
    if op in ("eval", "no_grad"):
        x, y = batch(program.model, i, dist.get_rank())
        if op == "eval":
            model.eval()
        try:
            with torch.no_grad():
                return {"loss": loss_of(model(x), y).item()}
        finally:
            model.train()
    if op == "state_dict":
        return _state_dict(program, side, model, step)
    if op == "optim_state_dict":
        return _optim_state_dict(program, side, model, opt, step)
    if op == "summon":
        with side.FSDP.summon_full_params(model, writeback=step.get("writeback", True),
                                          with_grads=step.get("with_grads", False)):
            out = {"full": _params(model)}
            if step.get("with_grads"):
                out["full_grads"] = _grads(model)
            if step.get("edit"):  # written back to the shards only with writeback=True
                with torch.no_grad():
                    next(iter(model.parameters())).add_(0.5)
        out["after"] = _params(model)
        return out
    if op == "unshard":
        handle = model.unshard(async_op=step.get("async_op", False))
        if handle is not None:
            handle.wait()
        model.reshard()
        return {}
    if op == "dcp_state_dict":
        return _dcp_state_dict(model, opt, step)
    raise ValueError(f"unknown step {op!r}")


def _final(program: Program, side: Side, model) -> dict:
    buffers = tensors_of(dict(model.named_buffers()))
    if program.impl == "fsdp1":
        with side.FSDP.summon_full_params(model):
            return {"full": _params(model), "buffers": buffers}
    full = [(n, p.full_tensor().detach().clone() if hasattr(p, "full_tensor") else p.detach().clone())
            for n, p in model.named_parameters()]
    return {"full": full, "buffers": buffers}


def run_side(program: Program, side_name: str, ctx: RankContext) -> dict:
    """Everything one side shows on this rank: ``wrapped`` (names, shapes, dtypes), ``steps`` (one dict each),
    ``final``, and ``error`` = (step index, -1 for wrapping; exception type; first line) if one raised."""
    side, recorder = Side.of(side_name), CollectiveRecorder()
    rec = {"wrapped": None, "steps": [], "final": None, "error": None}
    where = -1
    try:
        model = wrap(program, side, build_model(program.model, program.seed), ctx)
        rec["wrapped"] = [(n, tuple(p.shape), str(p.dtype), p.requires_grad) for n, p in model.named_parameters()]
        opt = _optimizer(program.optimizer, model)
        scaler = side.ShardedGradScaler(device="cpu") if program.options.get("scaler") else None
        for where, step in enumerate(program.steps):
            with recorder:
                out = _step(program, side, model, opt, scaler, where, step)
            collectives = recorder.take()
            if step["op"] in _TRAINS:
                out["collectives"] = collectives
            rec["steps"].append(out)
        where = len(program.steps)
        rec["final"] = _final(program, side, model)
    except Exception as e:  # noqa: BLE001 - the exception is the record
        message = str(e).strip().splitlines()
        rec["error"] = (where, error_of(e), message[0][:300] if message else "")
    return rec


def run_programs(programs_json: list[str], sides: tuple = ("torch", "ours")) -> list[dict]:
    """Rank function: every program on both sides (torch first); this rank's differences for each.

    Returns one dict per program run: ``differences`` (``compare.differences``), ``errors`` (each side's, on
    this rank), ``losses``.  If a side broke the process group (a rank raised while the others waited in a
    collective, so gloo closed the connections), the list ends with ``{"broken": side}`` for that program and
    the rest are not run here: the caller runs that program one side per spawn, and the rest in a fresh spawn.
    With one side, each dict holds that side's whole ``record``."""
    ctx, out = RankContext(), []
    # torch's and ours' warnings (NO_SHARD, state_dict_type, 1 rank) would print once per program per rank
    warnings.simplefilter("ignore")
    for text in programs_json:
        program = Program.from_json(text)
        records = {}
        for name in sides:
            records[name] = run_side(program, name, ctx)
            if ctx.settle(records[name]["error"]):
                return out + [{"broken": name, "record": records[name]}]
        if len(sides) == 1:
            out.append({"record": records[sides[0]]})
            continue
        out.append({"differences": differences(records["ours"], records["torch"], [s["op"] for s in program.steps]),
                    "errors": {k: r["error"] for k, r in records.items()},
                    "losses": [s.get("loss") for s in records["torch"]["steps"]]})
    return out
