"""Rank functions for the overlap and precision tests: mixed precision, activation checkpointing, prefetching.

Each worker trains ours and torch FSDP1 side by side on 2 ranks and returns
small numpy summaries; the test modules only compare them.
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from minifsdp.fsdp import FSDP, MixedPrecision, ShardedGradScaler, ShardingStrategy
from minifsdp.models import Block, TinyGPT
from tests._workers_fsdp import batch, policy, to_numpy, torch_strategy

STEPS = 4


def _torch_mp(mp: MixedPrecision):
    from torch.distributed.fsdp import MixedPrecision as TorchMP

    return TorchMP(param_dtype=mp.param_dtype, reduce_dtype=mp.reduce_dtype, buffer_dtype=mp.buffer_dtype)


def build_pair(strategy="FULL_SHARD", mp=None, use_orig_params=False, ours_kwargs=None, torch_kwargs=None):
    """(ours, torch FSDP1) on TinyGPT, blocks wrapped, same settings."""
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP

    ours = FSDP(TinyGPT(seed=0), auto_wrap_policy=policy("gpt", True), sharding_strategy=ShardingStrategy[strategy],
                mixed_precision=mp, use_orig_params=use_orig_params, **(ours_kwargs or {}))
    theirs = TorchFSDP(TinyGPT(seed=0), auto_wrap_policy=policy("gpt", False),
                       sharding_strategy=torch_strategy(ShardingStrategy[strategy]),
                       mixed_precision=_torch_mp(mp) if mp is not None else None, use_orig_params=use_orig_params,
                       device_id=torch.device("cpu"), **(torch_kwargs or {}))
    return ours, theirs


def summary(model, is_ours, losses, extra=None):
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP

    shards = [p.detach().clone() for p in model.parameters()]
    if is_ours:
        full = dict(model.state_dict())
    else:
        with TorchFSDP.summon_full_params(model):
            full = {_plain_name(k): v.detach().clone() for k, v in model.named_parameters()}
    out = dict(losses=losses, shards=shards, full=full, dtypes=[str(p.dtype) for p in model.parameters()])
    out.update(extra or {})
    return out


def _plain_name(name: str) -> str:
    return name.replace("_fsdp_wrapped_module.", "").replace("_checkpoint_wrapped_module.", "")


def train_plain(model, steps=STEPS, grad_dtypes=None):
    rank, world = dist.get_rank(), dist.get_world_size()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    losses = []
    for step in range(steps):
        x, y = batch("gpt", step, rank, world)
        loss = model(x, y)
        loss.backward()
        if grad_dtypes is not None:
            grad_dtypes.append(sorted({str(p.grad.dtype) for p in model.parameters() if p.grad is not None}))
        opt.step()
        opt.zero_grad()
        losses.append(loss.float().item())
    return losses


def train_scaled(model, scaler, inject_inf_at=None, steps=STEPS):
    """fp16 with loss scaling; at step ``inject_inf_at`` rank 1 writes inf into one of its gradient shards."""
    rank, world = dist.get_rank(), dist.get_world_size()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses, scales, stepped = [], [], []
    for step in range(steps):
        x, y = batch("gpt", step, rank, world)
        loss = model(x, y)
        scaler.scale(loss).backward()
        if step == inject_inf_at and rank == 1:
            next(iter(model.parameters())).grad[0] = float("inf")
        before = [p.detach().clone() for p in model.parameters()]
        scaler.step(opt)
        stepped.append(any(not torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True)))
        scaler.update()
        opt.zero_grad()
        losses.append(loss.float().item())
        scales.append(float(scaler.get_scale()))
    return losses, scales, stepped


MP_CASES = {
    "bf16": MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16, buffer_dtype=torch.bfloat16),
    "bf16_fp32reduce": MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
    "fp16": MixedPrecision(param_dtype=torch.float16),
}


def mixed_precision_worker():
    """Ours vs torch FSDP1 under the same MixedPrecision; ShardedGradScaler vs torch's."""
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler as TorchScaler

    out = {}
    for name, mp in MP_CASES.items():
        for strategy in ("FULL_SHARD", "SHARD_GRAD_OP"):
            ours, theirs = build_pair(strategy, mp)
            seen = []  # the dtype of a weight as the forward sees it
            qkv = ours.module.blocks[0].module.attn.qkv
            qkv.register_forward_pre_hook(lambda mod, args, seen=seen: seen.append(str(mod.weight.dtype)))
            gd_ours, gd_torch = [], []
            out[(name, strategy)] = dict(ours=summary(ours, True, train_plain(ours, grad_dtypes=gd_ours),
                                                      dict(grad_dtypes=gd_ours, compute_dtypes=seen)),
                                         torch=summary(theirs, False, train_plain(theirs, grad_dtypes=gd_torch),
                                                       dict(grad_dtypes=gd_torch)))
    ours, theirs = build_pair("FULL_SHARD", MP_CASES["bf16"], use_orig_params=True)
    out[("bf16", "orig_params")] = dict(ours=summary(ours, True, train_plain(ours)),
                                        torch=summary(theirs, False, train_plain(theirs)))
    # fp16 + grad scaler, with an inf injected on rank 1 only at step 1: every rank must skip that step.
    mp = MP_CASES["fp16"]
    ours, theirs = build_pair("FULL_SHARD", mp)
    lo, so, st_o = train_scaled(ours, ShardedGradScaler(init_scale=2.0**10, growth_interval=2), inject_inf_at=1)
    lt, s_t, st_t = train_scaled(theirs, TorchScaler(device="cpu", init_scale=2.0**10, growth_interval=2),
                                 inject_inf_at=1)
    out["scaler"] = dict(ours=summary(ours, True, lo, dict(scales=so, stepped=st_o)),
                         torch=summary(theirs, False, lt, dict(scales=s_t, stepped=st_t)))
    # The fp32 plain model's loss on the same data: how far bf16 moves it (for the stated tolerance).
    ours32, _ = build_pair("FULL_SHARD", None)
    out["fp32_losses"] = train_plain(ours32)
    # Buffers: a float buffer takes buffer_dtype at the first forward.
    m = FSDP(_WithFloatBuffer(), mixed_precision=MixedPrecision(param_dtype=torch.bfloat16,
                                                                buffer_dtype=torch.bfloat16))
    m(torch.ones(2, 4))
    out["buffer_dtype"] = str(m.module.scale.dtype)
    out["input_dtype"] = m.module.seen_dtype
    out["autocast_vs_mp"] = _autocast_vs_mp()
    return to_numpy(out)


def _autocast_vs_mp():
    """Output dtypes of a LayerNorm and a Linear: torch.amp autocast (per op) vs FSDP MixedPrecision (per param)."""
    seen = {}

    def record(tag):
        def hook(mod, args, out):
            seen[f"{tag}/{type(mod).__name__}"] = (str(out.dtype), str(mod.weight.dtype))
        return hook

    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = batch("gpt", 0, rank, world)
    plain = TinyGPT(seed=0)
    plain.blocks[0].ln1.register_forward_hook(record("autocast"))
    plain.blocks[0].attn.qkv.register_forward_hook(record("autocast"))
    with torch.autocast(device_type="cpu", dtype=torch.bfloat16):  # the source's torch.cuda.amp, device given
        plain(x, y)
    ours, _ = build_pair("FULL_SHARD", MP_CASES["bf16"])
    ours.module.blocks[0].module.ln1.register_forward_hook(record("fsdp_mp"))
    ours.module.blocks[0].module.attn.qkv.register_forward_hook(record("fsdp_mp"))
    ours(x, y)
    return seen


class _WithFloatBuffer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(4, 4)
        self.register_buffer("scale", torch.ones(4))
        self.seen_dtype = None

    def forward(self, x):
        self.seen_dtype = str(x.dtype)
        return self.lin(x) * self.scale



def _ac_check(m):
    return isinstance(m, Block)


def checkpointing_worker():
    """FSDP + our activation checkpointing vs FSDP without it, and vs torch FSDP1 + torch's checkpointing."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        checkpoint_wrapper,
    )
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        apply_activation_checkpointing as torch_apply,
    )

    from minifsdp.fsdp.activation_checkpointing import apply_activation_checkpointing
    from minifsdp.memory import MemoryTracker

    out = {}
    for orig in (False, True):
        ours, theirs = build_pair("FULL_SHARD", use_orig_params=orig)
        apply_activation_checkpointing(ours, check_fn=_ac_check)  # after wrapping: inside each unit
        torch_apply(theirs, check_fn=_ac_check,
                    checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper,
                                                            checkpoint_impl=CheckpointImpl.NO_REENTRANT))
        plain, _ = build_pair("FULL_SHARD", use_orig_params=orig)
        out[("ac", orig)] = dict(ours=summary(ours, True, train_plain(ours)),
                                 torch=summary(theirs, False, train_plain(theirs)),
                                 no_ac=summary(plain, True, train_plain(plain)))
    # Memory of one step: activations with and without checkpointing (MemoryTracker, rank-local).
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = batch("gpt", 0, rank, world)
    for ac in (False, True):
        model = FSDP(TinyGPT(seed=0), auto_wrap_policy=policy("gpt", True))
        if ac:
            apply_activation_checkpointing(model, check_fn=_ac_check)
        with MemoryTracker(model) as mt:
            model(x, y).backward()
        out[("peak", ac)] = dict(mt.breakdown_at_peak)
    # before wrapping works too, and checkpoints inside the unit (the Block's forward is patched)
    model = apply_activation_checkpointing(TinyGPT(seed=0), check_fn=_ac_check)
    model = FSDP(model, auto_wrap_policy=policy("gpt", True))
    out["before_wrap_losses"] = train_plain(model)
    return to_numpy(out)


PREFETCH_SETTINGS = {
    "none": dict(backward_prefetch=None),
    "pre": dict(backward_prefetch="BACKWARD_PRE"),
    "post": dict(backward_prefetch="BACKWARD_POST"),
    "fwd+pre": dict(backward_prefetch="BACKWARD_PRE", forward_prefetch=True),
    "fwd+post,nolimit": dict(backward_prefetch="BACKWARD_POST", forward_prefetch=True, limit_all_gathers=False),
}


def _settings(name, torch_side):
    from torch.distributed.fsdp import BackwardPrefetch as TorchBP

    from minifsdp.fsdp.core.prefetch import BackwardPrefetch

    kw = dict(PREFETCH_SETTINGS[name])
    bp = kw["backward_prefetch"]
    kw["backward_prefetch"] = None if bp is None else (TorchBP[bp] if torch_side else BackwardPrefetch[bp])
    return kw


class CollectiveLog(TorchDispatchMode):
    """This rank's all-gathers and reduce-scatters, in the order they were issued, whoever issued them.

    Since torch 2.0 every process-group call goes through the dispatcher as a ``c10d.*`` op,
    so a dispatch mode sees torch FSDP1's collectives and ours alike, with their tensors
    (``minifsdp.pictures.fsdp_plots.CollectiveTracer`` is built the same way; it names units
    through *our* handles only, so it cannot name torch's).  An all-gather is logged with
    the storage of its output: the unit's full flat buffer, whose storage object lives as
    long as the unit (only resized), so :meth:`named` maps it to the unit afterwards.  The
    units cannot be told apart by size: blocks.0 and blocks.1 have the same flat size.
    A reduce-scatter is logged with the numel of its input (the padded full gradient), an all-gather also
    with the numel of its output (:meth:`sized`).

    ``prefetching`` is a depth counter a caller raises while torch's ``_prefetch_handle``
    runs, so each all-gather also records whether torch issued it as a prefetch.  Torch
    FSDP1 on CPU issues its all-gathers synchronously (``dist.all_gather``), so this log's
    order is its issue order.
    """

    def __init__(self):
        super().__init__()
        self.log: list[tuple] = []
        self.prefetching = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._opname if func.namespace == "c10d" else ""
        if "allgather" in name:
            self.log.append(("all-gather", _first_tensor(args[0]).untyped_storage()._cdata, self.prefetching > 0,
                             sum(t.numel() for t in _tensors(args[0]))))
        elif "reduce_scatter" in name:
            self.log.append(("reduce-scatter", sum(t.numel() for t in _tensors(args[1]))))
        return func(*args, **(kwargs or {}))

    def sized(self) -> list[tuple[str, int]]:
        """Every collective as (kind, numel): an all-gather by its output's numel, a reduce-scatter by its input's
        (a unit's padded flat size, either way): where the units' sizes differ this names them on any FSDP,
        through nothing but the collectives it issued."""
        return [(e[0], e[3]) if e[0] == "all-gather" else e for e in self.log]

    def named(self, storages: dict) -> tuple[list, list]:
        """(all-gathers as (unit, prefetch), every collective as (kind, unit or numel)); ``storages``: cdata -> unit."""
        gathers = [(storages.get(e[1], f"unknown storage {e[1]}"), e[2]) for e in self.log if e[0] == "all-gather"]
        units = iter(gathers)
        seq = [(e[0], next(units)[0]) if e[0] == "all-gather" else e for e in self.log]
        return gathers, seq


def _first_tensor(obj):
    return obj if isinstance(obj, torch.Tensor) else _first_tensor(obj[0])


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    else:
        for v in obj:
            yield from _tensors(v)


@contextlib.contextmanager
def torch_prefetch_flag(log: CollectiveLog):
    """While torch FSDP1's ``_prefetch_handle`` runs, ``log.prefetching`` > 0 (it is looked up at call time)."""
    import torch.distributed.fsdp._runtime_utils as ru

    orig = ru._prefetch_handle

    def spy(*args, **kwargs):
        log.prefetching += 1
        try:
            return orig(*args, **kwargs)
        finally:
            log.prefetching -= 1

    ru._prefetch_handle = spy
    try:
        yield
    finally:
        ru._prefetch_handle = orig


def torch_unit_storages(model) -> dict:
    """torch FSDP1's all-gather targets (each handle's ``_full_param_padded``, created at lazy init) -> unit name."""
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP

    out = {}
    for name, m in model.named_modules():
        if isinstance(m, TorchFSDP) and m._handle is not None:
            out[m._handle.flat_param._full_param_padded.untyped_storage()._cdata] = _plain_name(name) or "root"
    return out


def our_unit_storages(model) -> dict:
    """Our all-gather targets (each handle's padded full buffer) -> the unit's name (as the tracer writes it)."""
    from minifsdp.fsdp.core.units import units

    return {u._handle.padded.untyped_storage()._cdata: u._handle.name for u in units(model) if u._handle is not None}


def prefetch_worker():
    """Every prefetch setting: ours vs torch FSDP1 (same setting) and vs ours without prefetch; traces.

    Per setting, the order in which each side issued its all-gathers (and reduce-scatters),
    recorded from both: ours from our tracer's "all-gather issued" events (and, as a check
    of the tracer, from the c10d ops), torch's from the c10d ops (:class:`CollectiveLog`).
    """
    from minifsdp.fsdp.core.handle import HandleState
    from minifsdp.fsdp.core.units import units

    def alive_units(every: list) -> int:  # non-root units whose full parameters are gathered or on their way
        return sum(1 for u in every[1:] if u._handle is not None and u._handle.sharded
                   and u._handle.state is not HandleState.SHARDED)
    from minifsdp.pictures.tracing import Tracer

    out = {}
    for strategy in ("FULL_SHARD", "SHARD_GRAD_OP"):
        for name in PREFETCH_SETTINGS:
            if strategy == "SHARD_GRAD_OP" and name not in ("none", "fwd+pre"):
                continue
            mp = MP_CASES["bf16"] if name == "fwd+pre" else None  # prefetch composes with mixed precision
            ours, theirs = build_pair(strategy, mp, ours_kwargs=_settings(name, False),
                                      torch_kwargs=_settings(name, True))
            alive = []
            for unit in ours.modules():
                if isinstance(unit, FSDP) and unit._handle is not None:
                    h = unit._handle
                    orig = h.start_unshard

                    def start(orig=orig, alive=alive, root=ours):
                        orig()
                        alive.append(alive_units(units(root)))

                    h.start_unshard = start
            ours_log = CollectiveLog()
            with Tracer(ours) as tr, ours_log:
                losses = train_plain(ours)
            issued = [(e.unit, bool(e.args.get("prefetch"))) for e in tr.events if e.kind == "all-gather issued"]
            ops_gathers, ops_seq = ours_log.named(our_unit_storages(ours))
            torch_log = CollectiveLog()
            with torch_prefetch_flag(torch_log), torch_log:
                torch_losses = train_plain(theirs)
            torch_issued, torch_seq = torch_log.named(torch_unit_storages(theirs))
            ours_extra = dict(issued=issued, issued_ops=[u for u, _ in ops_gathers], collectives=ops_seq,
                              max_alive=max(alive), exposed=tr.exposed_seconds(),
                              units=[u._handle.name for u in units(ours) if u._handle is not None],
                              events=[(e.kind, e.unit, e.start, e.end) for e in tr.events])
            out[(strategy, name)] = dict(ours=summary(ours, True, losses, ours_extra),
                                         torch=summary(theirs, False, torch_losses,
                                                       dict(issued=torch_issued, collectives=torch_seq)))
            if (strategy, name) == ("FULL_SHARD", "pre"):
                out["trace_files"] = _trace_files(ours, tr)
    return to_numpy(out)


def _trace_files(model, tr):
    """Gantt PNG, our Chrome trace, and a torch.profiler trace with our spans in it: what each contains."""
    import json
    import os
    import tempfile

    import matplotlib

    matplotlib.use("Agg")
    from minifsdp.pictures.tracing import Tracer, profile_to_chrome_trace

    folder = tempfile.mkdtemp(prefix="minifsdp_trace_")
    png, ours_json, prof_json = (os.path.join(folder, n) for n in ("gantt.png", "ours.json", "profiler.json"))
    ax = tr.plot()
    ax.figure.savefig(png)
    tr.export_chrome_trace(ours_json)
    rank, world = dist.get_rank(), dist.get_world_size()

    def step():
        x, y = batch("gpt", 0, rank, world)
        model(x, y).backward()

    with Tracer(model):
        profile_to_chrome_trace(step, prof_json)
    with open(ours_json) as f:
        kinds = sorted({e["name"] for e in json.load(f)["traceEvents"]})
    with open(prof_json) as f:
        names = [e.get("name", "") for e in json.load(f)["traceEvents"]]
    return dict(png_bytes=os.path.getsize(png), kinds=kinds,
                profiler_has_ours=any(n.startswith("minifsdp all-gather wait") for n in names),
                profiler_has_gloo=any("gloo" in n or "allgather" in n.lower() for n in names))
