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
import functools
import gc
import weakref
from unittest import mock

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.optim.optimizer as torch_optimizer
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor, Shard
from torch.testing._internal.common_fsdp import MLP
from torch.utils._python_dispatch import TorchDispatchMode

import minifsdp.fsdp2.core.collectives as ours_collectives
import minifsdp.fsdp2.core.param_group as ours_param_group
from minifsdp.comm.collectives import TorchCollectives
from minifsdp.fsdp2 import MixedPrecisionPolicy, fully_shard
from minifsdp.models import CharCorpus, GPTConfig, TinyGPT

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, None: None}


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
        saved_op = ours_collectives.gradient_divide_factors
        if impl == "ours" and case.get("fault") == "no_divide":  # sum instead of average
            ours_collectives.gradient_divide_factors = lambda *a, **k: (None, None, "sum", "sum")
        try:
            losses, collectives, loss_dtype = _train(model, case, rank, world)
        finally:
            ours_collectives.gradient_divide_factors = saved_op
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
        "2-D mesh without names": lambda m: fully_shard(m, mesh=init_device_mesh("cpu", (1, dist.get_world_size()))),
        "ModuleList": lambda m: fully_shard(m.blocks),
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


def placement_misuse() -> dict[str, tuple]:
    """``shard_placement_fn`` returning ``Shard(1)`` for every parameter of an ``nn.Linear``: the bias has one dim.
    For ours and torch's ``fully_shard``: (exception type, message, whether the module's parameters are still the
    originals, unsharded, after the refusal)."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    out = {}
    for impl, shard in (("torch", functools.partial(torch_fully_shard, mesh=mesh)), ("ours", fully_shard)):
        lin = nn.Linear(4, 6)
        before = dict(lin.named_parameters())
        try:
            shard(lin, shard_placement_fn=lambda p: Shard(1))
            out[impl] = ("no error", "", False)
        except Exception as e:  # noqa: BLE001 -- the test reads the type and message
            now = dict(lin.named_parameters())
            untouched = list(now) == list(before) and all(now[n] is p for n, p in before.items()) and \
                not any(isinstance(p, DTensor) for p in now.values())
            out[impl] = (type(e).__name__, str(e), untouched)
    return out


def grads_freed_before_reduce_scatter(fault: str | None = None) -> dict:
    """Are a group's full gradients dead when its reduce-scatter starts (torch FSDP2 clears them after the
    copy-in)?  Weak references to every full gradient handed to ``foreach_reduce``, checked inside the
    reduce-scatter: one still alive *and* referred to by a Python object is kept by us.  (Autograd's engine
    may still hold the last one it computed, from C++, with no Python referrer: that one is not ours to free.)
    ``fault="keep"`` plants the bug: a list that still holds them (as ``del`` of a local name did, while the
    caller's list held them).  Returns {"kept": full grads kept by a Python object at a reduce-scatter,
    "alive": alive at all, "handed": full grads handed over, "reduce_scatters": calls}."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = _shard(TinyGPT(GPTConfig.tiny(), seed=0), "ours", {}, None)
    report, handed, kept = {"kept": 0, "alive": 0, "handed": 0, "reduce_scatters": 0}, [], []
    real_group_rs, real_rs = ours_param_group.foreach_reduce, TorchCollectives.reduce_scatter

    def group_rs(group, params, grads):
        handed[:] = [weakref.ref(g) for g in grads]
        report["handed"] += len(grads)
        if fault == "keep":
            kept.extend(grads)
        return real_group_rs(group, params, grads)

    def rs(self, *args, **kwargs):
        alive = [g for g in (r() for r in handed) if g is not None]
        report["alive"] += len(alive)
        report["kept"] += sum(any(x is not alive for x in gc.get_referrers(g)) for g in alive)
        report["reduce_scatters"] += 1
        return real_rs(self, *args, **kwargs)

    with mock.patch.object(ours_param_group, "foreach_reduce", group_rs), \
            mock.patch.object(TorchCollectives, "reduce_scatter", rs):
        x, y = CharCorpus(vocab_size=model.cfg.vocab_size).batch(0, batch_size=2, block_size=model.cfg.block_size,
                                                                  rank=rank, world_size=world)
        model(x, y).backward()
    return report


# ---------------------------------------------------------------- results torch's own functions compute
def _local_of(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _whole(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _batch(cfg, step=0):
    return CharCorpus(vocab_size=cfg.vocab_size).batch(step, batch_size=2, block_size=cfg.block_size,
                                                       rank=dist.get_rank(), world_size=dist.get_world_size())


class _CountOps(TorchDispatchMode):
    """Counts the aten calls made while active (top level: a DTensor's own local calls are not counted)."""

    def __init__(self):
        super().__init__()
        self.calls: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


def _clip_grad_norm(impl, mesh, cfg) -> dict:
    """``torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)`` after one backward: the norm it returns (the whole
    of it) and the clipped local gradients.  Over sharded parameters the norm must be the global one."""
    model = _shard(TinyGPT(cfg, seed=0), impl, {}, mesh)
    x, y = _batch(cfg)
    model(x, y).backward()
    local_sq = sum(_local_of(p.grad).pow(2).sum() for p in model.parameters() if p.grad is not None)
    dist.all_reduce(local_sq)  # the global norm by hand: every rank's squares, summed
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.5)
    return {"norm": _whole(norm).clone(), "by_hand": local_sq.sqrt(), "local_norm_type": type(norm).__name__,
            "grads": {n: _local_of(p.grad).clone() for n, p in model.named_parameters()}}


def _grad_scaler_inf_on_last_rank(impl, mesh, cfg) -> dict:
    """``torch.amp.GradScaler``: an inf in one gradient on the last rank only.  Every rank must skip the step
    (parameters unchanged) and back the scale off; a rank that saw no inf and stepped would leave the ranks apart."""
    model = _shard(TinyGPT(cfg, seed=0), impl, {}, mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    x, y = _batch(cfg)
    scaler.scale(model(x, y)).backward()
    if dist.get_rank() == dist.get_world_size() - 1:
        _local_of(model.tok_emb.weight.grad)[0, 0] = float("inf")
    before = _locals(model)
    scaler.step(opt)
    scaler.update()
    after = _locals(model)
    return {"scale": scaler.get_scale(), "unchanged": all(torch.equal(before[n], after[n]) for n in before)}


def _state_dict_after_forward(impl, mesh, cfg) -> dict:
    """``reshard_after_forward=False``: ``state_dict()`` right after a forward (the full parameters are on the
    modules) must hold the sharded values, as between steps; the backward and a step after it still train."""
    model = _shard(TinyGPT(cfg, seed=0), impl, {"reshard_after_forward": False}, mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = _batch(cfg)
    loss = model(x, y)
    sd = model.state_dict()
    kinds = {k: (type(v).__name__, tuple(v.shape), tuple(_local_of(v).shape)) for k, v in sd.items()}
    loss.backward()
    opt.step()
    return {"state_dict": kinds, "locals": _locals(model)}


def _adamw_default_path(impl, mesh, cfg) -> dict:
    """Which AdamW path the default (``foreach=None``) picks over the sharded parameters on a device where the
    multi-tensor kernels exist (the CPU is declared one here, so this machine can ask), and the aten calls
    of one step taken that way: torch picks ``foreach`` only if ``type(p)`` is exactly Tensor, Parameter or DTensor."""
    model = _shard(TinyGPT(cfg, seed=0), impl, {}, mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = _batch(cfg)
    model(x, y).backward()
    with mock.patch.object(torch_optimizer, "_get_foreach_kernels_supported_devices", lambda: ["cpu"]):
        _, foreach = torch_optimizer._default_to_fused_or_foreach(list(model.parameters()), False, False)
        with _CountOps() as counter:
            opt.step()
    foreach_calls = sum("._foreach_" in c for c in counter.calls)
    return {"foreach": foreach, "calls": len(counter.calls), "foreach_calls": foreach_calls,
            "locals": _locals(model)}


def _misprefetch(impl, mesh, cfg) -> dict:
    """torch's misprefetch case: ``in_proj`` asked to prefetch ``out_proj`` in backward, after ``out_proj``'s
    backward already ran.  The prefetched gather must be dropped, not installed: 3 Adam steps, losses and shards."""
    torch.manual_seed(42)
    model = MLP(16)
    shard = fully_shard if impl == "ours" else functools.partial(torch_fully_shard, mesh=mesh)
    shard(model.in_proj)
    shard(model.out_proj)
    shard(model)
    model.in_proj.set_modules_to_backward_prefetch([model.out_proj])
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    torch.manual_seed(dist.get_rank() + 1)
    inp = torch.randn(2, 16)
    losses = []
    for _ in range(3):
        loss = model(inp).sum()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "locals": {n: _local_of(p).detach().clone() for n, p in model.named_parameters()}}


@dataclasses.dataclass
class Carried:
    """Activations a block hands on inside a dataclass (torch's pytree does not look into it)."""

    h: torch.Tensor
    scale: float = 1.0


class _DataclassBlock(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.lin = nn.Linear(dim, dim)

    def forward(self, c: Carried) -> Carried:
        return Carried(torch.relu(self.lin(c.h)) * c.scale, c.scale)


def _dataclass_activations(impl, mesh, cfg) -> dict:
    """Blocks that take and return a dataclass: the hooks must find the tensors inside (2 SGD steps)."""
    torch.manual_seed(0)
    model = nn.Sequential(*(_DataclassBlock(8) for _ in range(3)))
    shard = fully_shard if impl == "ours" else functools.partial(torch_fully_shard, mesh=mesh)
    for block in model:
        shard(block)
    shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    torch.manual_seed(dist.get_rank() + 1)
    losses = []
    for _ in range(2):
        out = model(Carried(torch.randn(4, 8, requires_grad=True)))
        out.h.sum().backward()
        opt.step()
        opt.zero_grad()
        losses.append(out.h.sum().item())
    return {"losses": losses, "locals": _locals(model)}


SILENT = {"clip_grad_norm": _clip_grad_norm, "grad_scaler": _grad_scaler_inf_on_last_rank,
          "state_dict_after_forward": _state_dict_after_forward, "adamw_default_path": _adamw_default_path,
          "misprefetch": _misprefetch, "dataclass_activations": _dataclass_activations}


def silent_results(names: list[str]) -> dict:
    """For each check in ``names``: ``{"torch": ..., "ours": ...}`` (an error is returned as its text)."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    cfg = GPTConfig(**{"vocab_size": 95, "n_embd": 33, "n_head": 3})
    out = {}
    for name in names:
        out[name] = {}
        for impl in ("torch", "ours"):
            torch.manual_seed(0)
            try:
                out[name][impl] = SILENT[name](impl, mesh, cfg)
            except Exception as e:  # noqa: BLE001 -- the test reports it
                out[name][impl] = f"{type(e).__name__}: {e}"
            dist.barrier()
    return out


def parity_cases(cases: dict[str, dict]) -> dict[str, dict]:
    """Several :func:`parity` cases in one spawn (one mesh, one process start): name -> result."""
    out = {}
    for name, case in cases.items():
        torch.manual_seed(0)
        if "silent" in case:
            out[name] = silent_results(case["silent"])
        elif "frees" in case:
            out[name] = grads_freed_before_reduce_scatter(case["frees"])
        elif case.get("placement_misuse"):
            out[name] = placement_misuse()
        elif case.get("root_reshard"):
            out[name] = root_reshard_after_forward()
        else:
            out[name] = misuse() if case.get("misuse") else parity(case)
    return out


# ---------------------------------------------------------------- the root's reshard_after_forward
# torch's fully_shard once clamped the root to reshard_after_forward=False whatever the user passed (its backward
# comes first: resharding it would only gather it straight back).  Users running a root's forward alone under
# no_grad (a text encoder before a diffusion model) found its full parameters kept, and torch changed the contract:
# an explicit True is respected at the root; the default, None, keeps the root's parameters.  For each way of
# asking, on ours and on torch's: the type of the root's parameters right after a forward (DTensor: resharded,
# Parameter: kept full) and each iteration's collectives (a: all-gather, r: reduce-scatter).
# name -> (fully_shard's keyword at the root, set_reshard_after_forward(True) before the first forward, eval)
WAYS = {
    "default": ({}, False, False),
    "explicit True": ({"reshard_after_forward": True}, False, False),
    "default, set to True": ({}, True, False),
    "default, eval": ({}, False, True),
    "explicit True, eval": ({"reshard_after_forward": True}, False, True),
}


def _root_types(model) -> list[str]:
    return sorted({type(p).__name__ for n, p in model.named_parameters() if not n.startswith("blocks.")})


def _run(shard, mesh, root_kw: dict, set_true: bool, evaluate: bool) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    model = TinyGPT(seed=0)
    for block in model.blocks:
        shard(block, mesh=mesh)
    shard(model, mesh=mesh, **root_kw)
    if set_true:
        model.set_reshard_after_forward(True, recurse=False)
    corpus = CharCorpus(vocab_size=model.cfg.vocab_size)
    types, collectives = [], []
    for it in range(2):
        x, y = corpus.batch(it, batch_size=2, block_size=model.cfg.block_size, rank=rank, world_size=world)
        log = []
        with record_collectives(log):
            with torch.no_grad() if evaluate else torch.enable_grad():
                loss = model(x, y)
            types.append(_root_types(model))
            if not evaluate:
                loss.backward()
        collectives.append("".join(kind[0] for kind, _, _ in log))
    return {"root types after forward": types, "collectives": collectives}


def root_reshard_after_forward() -> dict[str, dict[str, dict]]:
    """way -> {"torch": ..., "ours": ...}"""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    impls = (("torch", torch_fully_shard), ("ours", fully_shard))
    return {way: {impl: _run(shard, mesh, *spec) for impl, shard in impls} for way, spec in WAYS.items()}
