"""Rank function for tests/test_tensor_parallel.py: our tensor parallelism beside torch's, in one spawn.

``tp_worker`` runs on 2 ranks (gloo, CPU) and returns, per rank, plain tensors and counts that the tests
compare: for each case, ours (``minifsdp.parallel.tensor_parallel``) and torch's
(``torch.distributed.tensor.parallel.parallelize_module`` on ``init_device_mesh("cpu", (2,))``) with the same
plan, plus the unsharded model run in this process.  Collectives are counted with torch's own
``CommDebugMode``, which sees both torch's DTensor collectives and our ``dist.all_reduce``.
"""

from __future__ import annotations

import copy
import warnings

import torch
import torch.distributed as dist
import torch.distributed.tensor.parallel as ttp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode

import minifsdp.parallel.tensor_parallel as tp
from minifsdp.comm import count_bytes
from minifsdp.models import MLP, GPTConfig, TinyGPT

MLP_DIMS = (16, 32, 32, 8)  # net.0 stays whole, net.2 (32 -> 32) colwise, net.4 (32 -> 8) rowwise
MLP_OURS = {"net.2": tp.ColwiseParallel(), "net.4": tp.RowwiseParallel()}
MLP_TORCH = {"net.2": ttp.ColwiseParallel(), "net.4": ttp.RowwiseParallel()}
GPT_PLAN = {"blocks.*.attn.qkv": tp.ColwiseParallel(chunks=3), "blocks.*.attn.proj": tp.RowwiseParallel(),
            "blocks.*.mlp.0": tp.ColwiseParallel(), "blocks.*.mlp.2": tp.RowwiseParallel()}


def _local(t: torch.Tensor | None) -> torch.Tensor | None:
    if t is None:
        return None
    return (t.to_local() if isinstance(t, DTensor) else t).detach().clone()


def _params(model) -> dict[str, torch.Tensor]:
    return {n: _local(p) for n, p in model.named_parameters()}


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: _local(p.grad) for n, p in model.named_parameters()}


def _full_grads(model) -> dict[str, torch.Tensor]:
    """Every gradient whole: the sharded ones all-gathered (a collective), the others copied."""
    return {n: tp.full_tensor(p.grad, getattr(p, "tp_shard", None)).clone() for n, p in model.named_parameters()}


def _counts(mode: CommDebugMode) -> dict[str, int]:
    return {str(k).split(".")[-1]: v for k, v in mode.get_comm_counts().items()}


def _run(model, x, target):
    """One forward and backward; returns output, loss, the collectives each counted and our ring's bytes."""
    with CommDebugMode() as fwd, count_bytes() as fwd_bytes:
        out = model(x)
        loss = torch.nn.functional.mse_loss(out, target) if target is not None else out
    with CommDebugMode() as bwd, count_bytes() as bwd_bytes:
        loss.backward()
    return {"out": _local(out), "loss": _local(loss), "fwd": _counts(fwd), "bwd": _counts(bwd),
            "fwd_bytes": (fwd_bytes.sent, fwd_bytes.received, fwd_bytes.messages),
            "bwd_bytes": (bwd_bytes.sent, bwd_bytes.received, bwd_bytes.messages)}


def _mlp_case(mesh, x, target, optim=None, fault=None, ours_on=None, zero_row_bias=False, collectives="torch"):
    """Ours and torch's on the MLP: forward, backward, optionally two optimizer steps; ``fault`` breaks ours.

    ``ours_on``: what our ``parallelize_module`` gets (default: the same mesh as torch's; or a ProcessGroup).
    ``zero_row_bias``: zero the row-parallel layer's bias, the one place where torch adds in another order.
    ``collectives``: ours on gloo's all-reduce ("torch") or on our ring ("ring", whose bytes are counted).
    """
    base = MLP(MLP_DIMS, seed=0)
    if zero_row_bias:
        torch.nn.init.zeros_(base.net[4].bias)
    ours = tp.parallelize_module(copy.deepcopy(base), mesh if ours_on is None else ours_on, MLP_OURS,
                                 collectives=collectives)
    theirs = ttp.parallelize_module(copy.deepcopy(base), mesh, MLP_TORCH)
    saved = {}
    if fault == "skip backward all-reduce":  # f's backward without its all-reduce
        saved["f"] = tp._CopyToTensorParallel.backward
        tp._CopyToTensorParallel.backward = staticmethod(lambda ctx, grad: (grad, None, None))
    elif fault == "skip forward all-reduce":  # g's forward without its all-reduce
        saved["g"] = tp._ReduceFromTensorParallel.forward
        tp._ReduceFromTensorParallel.forward = staticmethod(lambda ctx, y, group, collectives: y.clone())
    try:
        res = {"init_ours": _params(ours), "init_torch": _params(theirs)}
        res["ours"], res["torch"] = _run(ours, x, target), _run(theirs, x, target)
    finally:
        if "f" in saved:
            tp._CopyToTensorParallel.backward = saved["f"]
        if "g" in saved:
            tp._ReduceFromTensorParallel.forward = saved["g"]
    res["grad_ours"], res["grad_torch"] = _grads(ours), _grads(theirs)
    with torch.no_grad():  # torch's order for the row-parallel bias, redone by hand: b / N added before the sum
        fc2 = ours.net[4]
        partial = torch.nn.functional.linear(ours.net[:4](x), fc2.weight, fc2.bias / dist.get_world_size())
        dist.all_reduce(partial)
        res["torch_order_out"] = partial
    res["full_grad_ours"] = _full_grads(ours) if fault is None else None
    res["full_param_ours"] = {n: tp.full_tensor(p).clone() for n, p in ours.named_parameters()}
    if optim is not None:
        for model in (ours, theirs):
            opt = optim(model.parameters())
            opt.step()
            opt.zero_grad()  # a second forward/backward/step, from the updated weights
            torch.nn.functional.mse_loss(model(x), target).backward()
            opt.step()
        res["step_ours"], res["step_torch"] = _params(ours), _params(theirs)
    # the unsharded model on the same data, in this process
    ref = copy.deepcopy(base)
    res["ref"] = {"out": ref(x).detach()}
    torch.nn.functional.mse_loss(ref(x), target).backward()
    res["ref"]["grad"] = _grads(ref)
    return res


def _attention_case(mesh, x):
    """One TinyGPT attention module: ours split by heads (chunks=3), ours and torch's cut contiguously."""
    base = TinyGPT(GPTConfig.tiny(), seed=0).blocks[0].attn
    res = {}
    plans = {
        "ours_heads": (tp.parallelize_module, {"qkv": tp.ColwiseParallel(chunks=3), "proj": tp.RowwiseParallel()}),
        "ours_contiguous": (tp.parallelize_module, {"qkv": tp.ColwiseParallel(), "proj": tp.RowwiseParallel()}),
        "torch_contiguous": (ttp.parallelize_module, {"qkv": ttp.ColwiseParallel(), "proj": ttp.RowwiseParallel()}),
    }
    for name, (parallelize, plan) in plans.items():
        model = parallelize(copy.deepcopy(base), mesh, plan)
        xi = x.clone().requires_grad_(True)
        with CommDebugMode() as fwd:
            out = model(xi)
        with CommDebugMode() as bwd:
            out.pow(2).sum().backward()
        run = {"out": _local(out), "x_grad": xi.grad.clone(), "grad": _grads(model), "params": _params(model),
               "fwd": _counts(fwd), "bwd": _counts(bwd)}
        if name.startswith("ours"):
            run["full_grad"] = _full_grads(model)
        res[name] = run
    ref = copy.deepcopy(base)
    xi = x.clone().requires_grad_(True)
    out = ref(xi)
    out.pow(2).sum().backward()
    res["ref"] = {"out": out.detach(), "x_grad": xi.grad.clone(), "grad": _grads(ref)}
    return res


def _gpt_case(group):
    """The whole tiny GPT, every block's attention and MLP split, against the unsharded GPT (loss, grads)."""
    base = TinyGPT(GPTConfig.tiny(), seed=0)
    g = torch.Generator().manual_seed(7)
    idx = torch.randint(0, base.cfg.vocab_size, (2, 16), generator=g)
    tgt = torch.randint(0, base.cfg.vocab_size, (2, 16), generator=g)
    ours = tp.parallelize_module(copy.deepcopy(base), group, GPT_PLAN)
    with CommDebugMode() as fwd:
        loss = ours(idx, tgt)
    with CommDebugMode() as bwd:
        loss.backward()
    full_grad = _full_grads(ours)
    ref = copy.deepcopy(base)
    ref_loss = ref(idx, tgt)
    ref_loss.backward()
    return {"loss": loss.detach(), "ref_loss": ref_loss.detach(), "full_grad": full_grad, "ref_grad": _grads(ref),
            "fwd": _counts(fwd), "bwd": _counts(bwd),
            "shapes": {n: tuple(p.shape) for n, p in ours.named_parameters()}}


def _errors(mesh) -> dict[str, str]:
    """The messages parallelize_module raises for bad plans (nothing is changed before it raises)."""
    msgs = {}
    cases = {
        "colwise_width": (MLP((16, 31, 8)), {"net.0": tp.ColwiseParallel(), "net.2": tp.RowwiseParallel()}),
        "rowwise_width": (MLP((16, 32, 32, 8)), {"net.4": tp.RowwiseParallel()}),  # fine: in=32
        "rowwise_odd": (MLP((16, 33, 8)), {"net.2": tp.RowwiseParallel()}),
        "fused_width": (MLP((16, 6, 8)), {"net.0": tp.ColwiseParallel(chunks=3)}),  # 6 = 3 x 2, 2 % 2 == 0: fine
        "fused_odd": (MLP((16, 9, 8)), {"net.0": tp.ColwiseParallel(chunks=3)}),  # 9 = 3 x 3, 3 % 2 != 0
        "missing_key": (MLP((16, 32, 8)), {"fc1": tp.ColwiseParallel()}),
        "not_linear": (MLP((16, 32, 8)), {"net.1": tp.ColwiseParallel()}),
    }
    for name, (model, plan) in cases.items():
        before = {n: p.shape for n, p in model.named_parameters()}
        try:
            tp.parallelize_module(model, mesh, plan)
            msgs[name] = "ok"
        except (ValueError, TypeError) as e:
            msgs[name] = f"{type(e).__name__}: {e}"
            assert before == {n: p.shape for n, p in model.named_parameters()}, f"{name}: changed before raising"
    try:  # a 2-D mesh (1 x 2) must be narrowed to its tensor-parallel dimension first
        tp.parallelize_module(MLP((16, 32, 8)), init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp")),
                              {"net.0": tp.ColwiseParallel()})
        msgs["mesh_2d"] = "ok"
    except ValueError as e:
        msgs["mesh_2d"] = f"ValueError: {e}"
    return msgs


def tp_worker() -> dict:
    # CommDebugMode hooks every module's backward; on an input that needs no gradient torch warns about it
    warnings.filterwarnings("ignore", message="Full backward hook is firing")
    torch.manual_seed(0)  # the same on every rank: tensor parallelism keeps the batch whole
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    g = torch.Generator().manual_seed(1)
    x, target = torch.randn(4, MLP_DIMS[0], generator=g), torch.randn(4, MLP_DIMS[-1], generator=g)
    ax = torch.randn(2, 8, GPTConfig.tiny().n_embd, generator=g)
    return {
        "mlp": _mlp_case(mesh, x, target),
        "mlp_zero_bias": _mlp_case(mesh, x, target, zero_row_bias=True),
        "mlp_ring": _mlp_case(mesh, x, target, collectives="ring"),
        "mlp_group": _mlp_case(mesh, x, target, ours_on=dist.group.WORLD),
        "sgd": _mlp_case(mesh, x, target, optim=lambda ps: torch.optim.SGD(ps, lr=0.1)),
        "adamw": _mlp_case(mesh, x, target, optim=lambda ps: torch.optim.AdamW(ps, lr=1e-2)),
        "fault_bwd": _mlp_case(mesh, x, target, fault="skip backward all-reduce"),
        "fault_fwd": _mlp_case(mesh, x, target, fault="skip forward all-reduce"),
        "attn": _attention_case(mesh, ax),
        "gpt": _gpt_case(dist.group.WORLD),
        "errors": _errors(mesh),
    }
