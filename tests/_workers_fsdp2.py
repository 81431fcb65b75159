"""Workers for tests/test_fsdp2.py: our ``minifsdp.fsdp2.fully_shard`` beside torch's FSDP2 on one rank set.

Each rank builds the same TinyGPT twice (same seed), shards one copy with ours and one with torch's
``torch.distributed.fsdp.fully_shard`` (blocks, then the root, on ``init_device_mesh("cpu", (N,))``),
trains both on the same batches with AdamW, and returns losses, every parameter's local shard (ours
``to_local()``, torch's ``DTensor.to_local()``), full tensors, and the order of the collectives each
issued (recorded by wrapping ``dist.all_gather_single`` / ``dist.reduce_scatter_single``, the calls
torch's FSDP2 and our ``get_collectives("torch")`` both make).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import weakref
from unittest import mock

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP
from torch.distributed.fsdp import fully_shard as torch_fully_shard

import minifsdp.fsdp2.param_group as ours_param_group
from minifsdp.comm.collectives import TorchCollectives
from minifsdp.fsdp2 import MixedPrecisionPolicy, fully_shard
from minifsdp.models import CharCorpus, GPTConfig, TinyGPT

_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, None: None}


@contextlib.contextmanager
def record_collectives(log: list):
    """Append (kind, numel, dtype) for each all-gather / reduce-scatter / all-reduce issued inside the block."""
    saved = {name: getattr(dist, name) for name in ("all_gather_single", "reduce_scatter_single")}

    def wrap(name, fn):
        def recorded(output, input, *args, **kwargs):
            log.append((name.split("_")[0] + "_" + name.split("_")[1], input.numel(), str(input.dtype)))
            return fn(output, input, *args, **kwargs)
        return recorded

    saved["all_reduce"] = dist.all_reduce

    def all_reduce(tensor, *args, **kwargs):  # HSDP's average over the replicas
        log.append(("all_reduce", tensor.numel(), str(tensor.dtype)))
        return saved["all_reduce"](tensor, *args, **kwargs)

    for name, fn in saved.items():
        setattr(dist, name, all_reduce if name == "all_reduce" else wrap(name, fn))
    try:
        yield log
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


def _shard(model, impl, case, mesh):
    for name, p in model.named_parameters():
        if name.startswith(tuple(case.get("freeze", ()))):
            p.requires_grad_(False)
    reshard = case.get("reshard_after_forward")
    if impl == "ours":
        mp = MixedPrecisionPolicy(param_dtype=_DTYPES[case.get("param_dtype")],
                                  reduce_dtype=_DTYPES[case.get("reduce_dtype")])
        root_mp = dataclasses.replace(mp, output_dtype=_DTYPES[case.get("root_output_dtype")])
        kw = {"mesh": mesh if case.get("ours_mesh") else None, "collectives": case.get("collectives", "torch")}
        for block in model.blocks:
            fully_shard(block, reshard_after_forward=reshard, mp_policy=mp, **kw)
        return fully_shard(model, reshard_after_forward=reshard, mp_policy=root_mp, **kw)
    mp = TorchMP(param_dtype=_DTYPES[case.get("param_dtype")], reduce_dtype=_DTYPES[case.get("reduce_dtype")])
    root_mp = dataclasses.replace(mp, output_dtype=_DTYPES[case.get("root_output_dtype")])
    for block in model.blocks:
        torch_fully_shard(block, mesh=mesh, reshard_after_forward=reshard, mp_policy=mp)
    return torch_fully_shard(model, mesh=mesh, reshard_after_forward=reshard, mp_policy=root_mp)


def _train(model, case, rank, world):
    cfg = model.cfg
    corpus = CharCorpus(vocab_size=cfg.vocab_size)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    losses, collectives = [], []
    micro = case.get("accumulate", 1)
    with record_collectives(collectives):
        for step in range(case.get("steps", 3)):
            for k in range(micro):
                if micro > 1:
                    model.set_requires_gradient_sync(k == micro - 1)
                x, y = corpus.batch(step * micro + k, batch_size=2, block_size=cfg.block_size, rank=rank,
                                    world_size=world)
                loss = model(x, y)
                loss.backward()
                losses.append(loss.detach().float().item())
                dtypes = str(loss.dtype)
            opt.step()
            opt.zero_grad()
    return losses, collectives, dtypes


def _locals(model) -> dict[str, torch.Tensor]:
    return {name: p.to_local().detach().clone() for name, p in model.named_parameters()}


def parity(case: dict) -> dict:
    """Ours and torch's FSDP2 trained side by side; ``case["fault"] == "no_divide"`` plants a bug in ours."""
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = GPTConfig(**case.get("cfg", {}))
    shape = tuple(case.get("mesh", (world,)))
    names = ("replicate", "shard") if len(shape) == 2 else None
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    result = {}
    for impl in case.get("impls", ("torch", "ours")):
        model = _shard(TinyGPT(cfg, seed=0), impl, case, mesh)
        if case.get("prefetch"):  # each block gathers the next in forward; the root gathers all in backward
            blocks = list(model.blocks)
            for block, following in zip(blocks[:-1], blocks[1:]):
                block.set_modules_to_forward_prefetch([following])
            model.set_modules_to_backward_prefetch(blocks[::-1])
        saved_op = ours_param_group.reduce_scatter_op
        if impl == "ours" and case.get("fault") == "no_divide":  # sum instead of average
            ours_param_group.reduce_scatter_op = lambda n, dtype: ("sum", None, None)
        try:
            losses, collectives, loss_dtype = _train(model, case, rank, world)
        finally:
            ours_param_group.reduce_scatter_op = saved_op
        result[impl] = {
            "class": type(model).__name__,
            "losses": losses,
            "locals": _locals(model),
            "full": {name: p.full_tensor().detach().clone() for name, p in model.named_parameters()},
            "collectives": collectives,
            "grad_is_none": all(p.grad is None for p in model.parameters()),
            "buffers": {name: b.clone() for name, b in model.named_buffers()},
            "loss_dtype": loss_dtype,
            "state_dict": {k: (type(v).__name__, tuple(_local(v).shape)) for k, v in model.state_dict().items()},
            "requires_grad": [p.requires_grad for p in model.parameters()],
        }
        if case.get("api"):
            result[impl].update(_api(model, cfg, rank, world))
    return result


def _local(p):
    return p.to_local() if hasattr(p, "to_local") else p


def _api(model, cfg, rank, world) -> dict:
    """After training: eval forward under no_grad, then ``unshard()`` / ``reshard()`` by hand."""
    x, _ = CharCorpus(vocab_size=cfg.vocab_size).batch(99, 2, cfg.block_size, rank, world)
    with torch.no_grad():
        logits = model(x)
    model.unshard()
    gathered = {name: (tuple(_local(p).shape), type(p).__name__, _local(p).detach().clone())
                for name, p in model.named_parameters()}
    model.reshard()
    after = {name: (tuple(_local(p).shape), tuple(p.shape)) for name, p in model.named_parameters()}
    return {"eval_logits": logits, "unsharded": gathered, "resharded_shapes": after}


def misuse() -> list[tuple[str, str, str]]:
    """What our ``fully_shard`` says when misused: (what, exception type, message)."""
    attempts = {
        "twice": lambda m: fully_shard(fully_shard(m)),
        "int not dividing": lambda m: fully_shard(m, reshard_after_forward=3),
        "cpu offload": lambda m: fully_shard(m, offload_policy=CPUOffloadPolicy()),
        "3-D mesh": lambda m: fully_shard(m, mesh=init_device_mesh("cpu", (1, 1, dist.get_world_size()))),
    }
    out = []
    for what, attempt in attempts.items():
        try:
            attempt(TinyGPT(GPTConfig(), seed=0))
            out.append((what, "no error", ""))
        except Exception as e:  # noqa: BLE001 -- the test reads the type and message
            out.append((what, type(e).__name__, str(e)))
    model = fully_shard(TinyGPT(GPTConfig(), seed=0))
    handle = model.unshard(async_op=True)
    handle.wait()
    out.append(("unshard(async_op=True)", type(model.tok_emb.weight).__name__, str(tuple(model.tok_emb.weight.shape))))
    return out


def grads_freed_before_reduce_scatter(fault: str | None = None) -> dict:
    """Are a group's full gradients dead when its reduce-scatter starts (torch FSDP2 clears them after the
    copy-in)?  Weak references to every full gradient handed to ``reduce_scatter_grads``, checked inside the
    reduce-scatter: one still alive *and* referred to by a Python object is kept by us.  (Autograd's engine
    may still hold the last one it computed, from C++, with no Python referrer: that one is not ours to free.)
    ``fault="keep"`` plants the bug: a list that still holds them (as ``del`` of a local name did, while the
    caller's list held them).  Returns {"kept": full grads kept by a Python object at a reduce-scatter,
    "alive": alive at all, "handed": full grads handed over, "reduce_scatters": calls}."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = _shard(TinyGPT(GPTConfig.tiny(), seed=0), "ours", {}, None)
    report, handed, kept = {"kept": 0, "alive": 0, "handed": 0, "reduce_scatters": 0}, [], []
    real_group_rs, real_rs = ours_param_group.FSDPParamGroup.reduce_scatter_grads, TorchCollectives.reduce_scatter

    def group_rs(self, params, grads):
        handed[:] = [weakref.ref(g) for g in grads]
        report["handed"] += len(grads)
        if fault == "keep":
            kept.extend(grads)
        return real_group_rs(self, params, grads)

    def rs(self, *args, **kwargs):
        alive = [g for g in (r() for r in handed) if g is not None]
        report["alive"] += len(alive)
        report["kept"] += sum(any(x is not alive for x in gc.get_referrers(g)) for g in alive)
        report["reduce_scatters"] += 1
        return real_rs(self, *args, **kwargs)

    with mock.patch.object(ours_param_group.FSDPParamGroup, "reduce_scatter_grads", group_rs), \
            mock.patch.object(TorchCollectives, "reduce_scatter", rs):
        x, y = CharCorpus(vocab_size=model.cfg.vocab_size).batch(0, batch_size=2, block_size=model.cfg.block_size,
                                                                  rank=rank, world_size=world)
        model(x, y).backward()
    return report


def parity_cases(cases: dict[str, dict]) -> dict[str, dict]:
    """Several :func:`parity` cases in one spawn (one mesh, one process start): name -> result."""
    out = {}
    for name, case in cases.items():
        torch.manual_seed(0)
        if "frees" in case:
            out[name] = grads_freed_before_reduce_scatter(case["frees"])
        else:
            out[name] = misuse() if case.get("misuse") else parity(case)
    return out
