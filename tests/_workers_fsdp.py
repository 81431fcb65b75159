"""Rank functions for the FSDP tests: train ours and torch's side by side, return small summaries.

One ``spawn`` per world size trains every variant (strategy x model x optimizer)
in turn, so the tests pay the process start-up once.
"""

from __future__ import annotations

import functools

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from minifsdp.fsdp import FSDP, ShardingStrategy
from minifsdp.fsdp.core.wrap import transformer_auto_wrap_policy
from minifsdp.fsdp.torch_options import hybrid_groups, size_based_auto_wrap_policy
from minifsdp.models import MLP, Block, CharCorpus, TinyGPT

STEPS = 5
BATCH = 4


def make_model(kind: str):
    return TinyGPT(seed=0) if kind == "gpt" else MLP((16, 32, 32, 8), seed=0)


def policy(kind: str, ours: bool):
    """Nested wrapping: each GPT Block; for the MLP, Linears of >= 500 parameters (2 of 3)."""
    if kind == "gpt":
        fn = transformer_auto_wrap_policy if ours else _torch_wrap().transformer_auto_wrap_policy
        return functools.partial(fn, transformer_layer_cls={Block})
    fn = size_based_auto_wrap_policy if ours else _torch_wrap().size_based_auto_wrap_policy
    return functools.partial(fn, min_num_params=500)


def _torch_wrap():
    import torch.distributed.fsdp.wrap as w

    return w


_CORPUS = []


def batch(kind, step, rank, world):
    if kind == "gpt":
        if not _CORPUS:
            _CORPUS.append(CharCorpus())
        return _CORPUS[0].batch(step, BATCH, 32, rank, world)
    return MLP((16, 32, 32, 8)).batch(step, BATCH, rank, world)


def loss_of(kind, model, x, y):
    return model(x, y) if kind == "gpt" else F.mse_loss(model(x), y)


def make_opt(name, params):
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def train(model, kind, opt_name, rank, world, clip=True):
    """STEPS steps; returns losses and the grad norms that clip_grad_norm_ reported (``clip``: the model's
    method if True, torch's plain function if "plain", or a function ``clip(model, max_norm)``)."""
    opt = make_opt(opt_name, model.parameters())
    losses, norms = [], []
    for step in range(STEPS):
        x, y = batch(kind, step, rank, world)
        loss = loss_of(kind, model, x, y)
        loss.backward()
        if clip == "plain":  # FSDP2: parameters are DTensors, torch's ordinary function handles them
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        elif callable(clip):
            norms.append(clip(model, 0.5).item())
        elif clip:
            norms.append(model.clip_grad_norm_(0.5).item())
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, norms


def torch_strategy(s: ShardingStrategy):
    from torch.distributed.fsdp import ShardingStrategy as T

    return T[s.name]


def groups_for(strategy):
    """(ours, torch's) process_group arguments for HYBRID_SHARD and _HYBRID_SHARD_ZERO2 (2 x 2), else ({}, {}).

    Ours gets a 2-D DeviceMesh (replicate dim first, shard second), torch the
    (shard_group, replicate_group) tuple over the same ranks: the bitwise test
    then proves our mesh path builds exactly torch's groups.
    """
    if strategy in (ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2):
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (dist.get_world_size() // 2, 2))
        return {"device_mesh": mesh}, {"process_group": hybrid_groups(2)}
    return {}, {}


def fsdp_pair(kind, strategy, mixed_precision=None, use_orig_params=False, collectives="torch"):
    """(ours, torch FSDP1) on ``make_model(kind)``, nested wrapping, the same strategy, groups and MixedPrecision.

    ``mixed_precision`` is ours (``minifsdp.MixedPrecision``); torch's side gets torch's with the same dtypes.
    """
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
    from torch.distributed.fsdp import MixedPrecision as TorchMP

    ours_groups, torch_groups = groups_for(strategy)
    mp = mixed_precision
    torch_mp = None if mp is None else TorchMP(param_dtype=mp.param_dtype, reduce_dtype=mp.reduce_dtype,
                                               buffer_dtype=mp.buffer_dtype)
    ours = FSDP(make_model(kind), **ours_groups, sharding_strategy=strategy, mixed_precision=mp,
                use_orig_params=use_orig_params, auto_wrap_policy=policy(kind, True), collectives=collectives)
    theirs = TorchFSDP(make_model(kind), **torch_groups, sharding_strategy=torch_strategy(strategy),
                       mixed_precision=torch_mp, use_orig_params=use_orig_params,
                       auto_wrap_policy=policy(kind, False), device_id=torch.device("cpu"))
    return ours, theirs


def run_variant(kind, strategy, opt_name, collectives="torch"):
    """Ours and torch FSDP1 on the same seed and data; returns both summaries."""
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP

    rank, world = dist.get_rank(), dist.get_world_size()
    ours, theirs = fsdp_pair(kind, strategy, collectives=collectives)
    out = {}
    for name, model in (("ours", ours), ("torch", theirs)):
        losses, norms = train(model, kind, opt_name, rank, world)
        shards = [p.detach().clone() for p in model.parameters()]  # each unit's local flat shard, pre-order
        if name == "ours":
            full = {k: v for k, v in model.state_dict().items()}
        else:
            with TorchFSDP.summon_full_params(model):
                full = {k.replace("_fsdp_wrapped_module.", ""): v.detach().clone()
                        for k, v in model.named_parameters()}
        out[name] = dict(losses=losses, norms=norms, shards=shards, full=full)
    return out


def run_fsdp2(kind, reshard_after_forward: bool):
    """torch FSDP2 (fully_shard on each nested unit, then the root): full parameters after training."""
    from torch.distributed.fsdp import fully_shard

    rank, world = dist.get_rank(), dist.get_world_size()
    model = make_model(kind)
    units = list(model.blocks) if kind == "gpt" else [model.net[0], model.net[2]]
    for m in units:
        fully_shard(m, reshard_after_forward=reshard_after_forward)
    fully_shard(model, reshard_after_forward=reshard_after_forward)
    losses, _ = train(model, kind, "adamw", rank, world, clip="plain")
    full = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
    return dict(losses=losses, full=full)


def run_single(kind, opt_name, world):
    """The single-process oracle: the plain model on the global batch (all ranks' rows)."""
    model = make_model(kind)
    opt = make_opt(opt_name, model.parameters())
    losses = []
    for step in range(STEPS):
        parts = [batch(kind, step, r, world) for r in range(world)]
        x, y = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
        loss = loss_of(kind, model, x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return dict(losses=losses, full={k: v.clone() for k, v in model.state_dict().items()})


def parity_worker(world: int, variants: list, fsdp2: list, collectives_variants: list):
    """Every variant on this rank; returns {key: summary}."""
    results = {}
    for kind, strategy_name, opt_name in variants:
        results[(kind, strategy_name, opt_name, "torch")] = run_variant(kind, ShardingStrategy[strategy_name],
                                                                        opt_name)
    for kind, strategy_name, opt_name in collectives_variants:
        results[(kind, strategy_name, opt_name, "ring")] = run_variant(kind, ShardingStrategy[strategy_name],
                                                                       opt_name, collectives="ring")
    for kind, raf in fsdp2:
        results[("fsdp2", kind, raf)] = run_fsdp2(kind, raf)
    if dist.get_rank() == 0:
        for kind in ("gpt", "mlp"):
            for opt_name in ("sgd", "adamw"):
                results[("single", kind, opt_name)] = run_single(kind, opt_name, world)
    return to_numpy(results)


def pairs(a, b):
    """``zip(a, b)`` for comparing results, after asserting both have the same length (a shorter list fails)."""
    a, b = list(a), list(b)
    assert len(a) == len(b), f"{len(a)} items against {len(b)}"
    return zip(a, b)


_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(t: torch.Tensor) -> torch.Tensor:
    """A tensor's numbers as integers of the same width, one per number: equal iff the bits are."""
    flat = t.detach().cpu().contiguous().reshape(-1)
    return flat.view(_SAME_SIZE_INT.get(flat.element_size(), torch.uint8))


def assert_bitwise(ours, theirs, what: str = "result") -> None:
    """``ours`` is bit for bit ``theirs``: the one comparison the side-by-side tests share.

    Nested dicts (the same keys in the same order), lists and tuples (the same length: a shorter one
    fails), torch tensors and numpy arrays (the same dtype, shape and bytes: ``-0.0`` is not ``0.0``, and
    a NaN equals only the same NaN; an ``nn.Parameter`` compares as the tensor it is), anything else by
    ``==`` and of the same type (``1`` is not ``1.0``, a list is not a tuple).  A failure names the path
    to the first difference and, for tensors and arrays, how many numbers differ and by how much at most.
    """
    if isinstance(ours, torch.Tensor) or isinstance(theirs, torch.Tensor):
        assert isinstance(ours, torch.Tensor) and isinstance(theirs, torch.Tensor), \
            f"{what}: {type(ours).__name__} vs {type(theirs).__name__}"
        assert (ours.dtype, tuple(ours.shape)) == (theirs.dtype, tuple(theirs.shape)), \
            f"{what}: {ours.dtype}{tuple(ours.shape)} vs {theirs.dtype}{tuple(theirs.shape)}"
        a, b = _bits(ours), _bits(theirs)
        if not torch.equal(a, b):
            diff = (ours.detach().cpu().double() - theirs.detach().cpu().double()).abs().reshape(-1)
            raise AssertionError(f"{what}: {int((a != b).sum())} of {a.numel()} numbers differ, max abs "
                                 f"difference {float(diff.nan_to_num(float('inf')).max()):.3g}")
    elif isinstance(ours, np.ndarray) or isinstance(theirs, np.ndarray):
        a, b = np.asarray(ours), np.asarray(theirs)
        assert (a.dtype, a.shape) == (b.dtype, b.shape), f"{what}: {a.dtype}{a.shape} vs {b.dtype}{b.shape}"
        if a.tobytes() != b.tobytes():
            differ = a != b if a.dtype.kind != "f" else ~((a == b) & (np.signbit(a) == np.signbit(b)))
            diff = np.abs(a.astype(np.float64) - b.astype(np.float64))
            raise AssertionError(f"{what}: {int(differ.sum())} of {a.size} numbers differ, max abs difference "
                                 f"{np.nanmax(diff) if diff.size else 0:.3g}")
    else:
        assert type(ours) is type(theirs), f"{what}: {type(ours).__name__} {ours!r} vs {type(theirs).__name__} " \
                                           f"{theirs!r}"
        if isinstance(ours, dict):
            assert list(ours) == list(theirs), f"{what}: keys {list(ours)} vs {list(theirs)}"
            for k in ours:
                assert_bitwise(ours[k], theirs[k], f"{what}[{k!r}]")
        elif isinstance(ours, (list, tuple)):
            assert len(ours) == len(theirs), f"{what}: {len(ours)} items against {len(theirs)}"
            for i, (a, b) in enumerate(zip(ours, theirs)):
                assert_bitwise(a, b, f"{what}[{i}]")
        else:
            assert ours == theirs, f"{what}: {ours!r} vs {theirs!r}"


def assert_same_training(ours: dict, theirs: dict, what: str, kind: str = "gpt") -> None:
    """Two training summaries (losses, shards, full) are bit for bit one run: the losses (and the clipping norms where
    both recorded them), each unit's local flat shard, and every full parameter (:func:`full_items`: both
    name what they should, so a summary that lost a parameter fails)."""
    assert len(ours["losses"]) > 0, f"{what}: no losses"
    assert_bitwise(ours["losses"], theirs["losses"], f"{what}: losses")
    if "norms" in ours or "norms" in theirs:
        assert_bitwise(ours["norms"], theirs["norms"], f"{what}: clipping norms")
    assert_bitwise(ours["shards"], theirs["shards"], f"{what}: local flat shards")
    for name, a, b in full_items(ours["full"], theirs["full"], kind):
        assert_bitwise(a, b, f"{what}: {name}")


def bitwise_differences(ours, theirs) -> list:
    """The keys (dicts) or indices (lists) whose values are not :func:`assert_bitwise`-equal, then those on one
    side only; an empty list: equal.  For a rank function that reports rather than asserts, and for checks
    that a planted fault is seen (the list must not be empty)."""
    if isinstance(ours, dict) and isinstance(theirs, dict):
        keys, extra = list(ours), [k for k in theirs if k not in ours]
    else:
        keys, extra = list(range(min(len(ours), len(theirs)))), list(range(min(len(ours), len(theirs)),
                                                                            max(len(ours), len(theirs))))
    bad = []
    for k in keys:
        try:
            assert isinstance(ours, (list, tuple)) or k in theirs
            assert_bitwise(ours[k], theirs[k], str(k))
        except AssertionError:
            bad.append(k)
    return bad + extra


def full_items(ours: dict, theirs: dict, kind: str = "gpt"):
    """``(name, ours, theirs)`` for every tensor in ``theirs``, after checking both dicts name what they should.

    A full-parameter dict here is either a state dict of the plain ``make_model(kind)`` (ours,
    the single-process model) or its parameters alone (torch's ``named_parameters()`` under
    ``summon_full_params``: no buffers, a tied weight once); ``theirs`` must have every name
    of one of the two and ``ours`` every name of ``theirs``, so a dict that lost entries fails.
    """
    plain = make_model(kind)
    whole, params = set(plain.state_dict()), {n for n, _ in plain.named_parameters()}
    assert set(ours) in (whole, params), sorted(set(ours) ^ whole)
    assert set(theirs) in (whole, params), sorted(set(theirs) ^ params)
    assert set(theirs) <= set(ours), sorted(set(theirs) - set(ours))
    return [(name, ours[name], b) for name, b in theirs.items()]


def to_numpy(obj):
    """Tensors -> numpy arrays (pickled by value; torch tensors would travel as shared memory)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu().numpy().copy()
    if isinstance(obj, dict):
        return {k: to_numpy(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_numpy(v) for v in obj)
    return obj


def _decay_groups(named):
    """Optimizer groups by name: no weight decay on 1-D parameters (norms, biases), as in nanoGPT."""
    decay = [p for n, p in named if p.dim() >= 2 and p.numel() > 0 and "ln" not in n and "bias" not in n]
    rest = [p for n, p in named if not any(p is q for q in decay)]
    return [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]


def _orig_groups(model):
    """Groups decided from the ORIGINAL names and shapes (use_orig_params=True shows both)."""
    plain = dict(make_model("gpt").named_parameters())
    named = [(n.replace("_fsdp_wrapped_module.", ""), p) for n, p in model.named_parameters()]
    decay = [p for n, p in named if plain[n].dim() >= 2]
    rest = [p for n, p in named if plain[n].dim() < 2]
    return [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]


def features_worker():
    """use_orig_params, no_sync, summon_full_params and state dicts, each against torch FSDP1 or the plain model."""
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP

    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    # 1. use_orig_params=True with weight-decay groups chosen by original name and shape.
    ours = FSDP(make_model("gpt"), auto_wrap_policy=policy("gpt", True), use_orig_params=True)
    theirs = TorchFSDP(make_model("gpt"), auto_wrap_policy=policy("gpt", False), use_orig_params=True,
                       device_id=torch.device("cpu"))
    out["orig_names"] = [n for n, _ in ours.named_parameters()]
    out["torch_orig_names"] = [n for n, _ in theirs.named_parameters()]
    out["plain_names"] = [n for n, _ in make_model("gpt").named_parameters()]
    for name, model in (("ours", ours), ("torch", theirs)):
        opt = torch.optim.AdamW(_orig_groups(model), lr=1e-2)
        losses = []
        for step in range(STEPS):
            x, y = batch("gpt", step, rank, world)
            loss = model(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        flat = [m.flat_param for m in ours.modules() if isinstance(m, FSDP)] if name == "ours" else \
            [m._flat_param for m in TorchFSDP.fsdp_modules(model)]
        out[f"orig_{name}"] = dict(losses=losses, flat=[f.detach().clone() for f in flat],
                                   shapes=[tuple(p.shape) for _, p in model.named_parameters()])
        with (FSDP if name == "ours" else TorchFSDP).summon_full_params(model):
            out[f"orig_{name}"]["full"] = {n.replace("_fsdp_wrapped_module.", ""): p.detach().clone()
                                           for n, p in model.named_parameters()}
            out[f"orig_{name}"]["full_shapes"] = [tuple(p.shape) for _, p in model.named_parameters()]
    # 2. no_sync: the first of two micro-batches accumulates locally, forward AND backward inside.
    for name in ("ours", "torch"):
        model = FSDP(make_model("gpt"), auto_wrap_policy=policy("gpt", True)) if name == "ours" else \
            TorchFSDP(make_model("gpt"), auto_wrap_policy=policy("gpt", False), device_id=torch.device("cpu"))
        opt = make_opt("sgd", model.parameters())
        for step in range(3):
            x, y = batch("gpt", step, rank, world)
            with model.no_sync():
                model(x[:2], y[:2]).backward()
            model(x[2:], y[2:]).backward()
            opt.step()
            opt.zero_grad()
        out[f"nosync_{name}"] = [p.detach().clone() for p in model.parameters()]
    # 3. summon_full_params with writeback, full state dict into the plain model, and back.
    model = FSDP(make_model("gpt"), auto_wrap_policy=policy("gpt", True))
    train(model, "gpt", "adamw", rank, world)
    before = model.state_dict()["ln_f.weight"]
    with FSDP.summon_full_params(model):
        out["summon_shapes"] = {n: tuple(getattr(model.module.blocks[0].module.attn.qkv, n).shape)
                                for n in ("weight", "bias")}
        with torch.no_grad():  # full parameters are nn.Parameters inside, as in torch: edit them under no_grad
            model.module.ln_f.weight.add_(1.0)  # an edit that writeback must keep
    sd = model.state_dict()
    out["writeback_kept_edit"] = bool(torch.equal(sd["ln_f.weight"], before + 1.0))
    plain = make_model("gpt")
    plain.load_state_dict(sd)  # strict: every name the plain model has, no more
    x, y = batch("gpt", 99, 0, 1)
    with torch.no_grad():
        out["eval_fsdp"] = model(x, y)
        out["eval_plain"] = plain(x, y)
    out["sd_keys"] = sorted(sd)
    out["plain_keys"] = sorted(make_model("gpt").state_dict())
    out["tied_in_sd"] = bool(torch.equal(sd["lm_head.weight"], sd["tok_emb.weight"]))
    fresh = FSDP(TinyGPT(seed=1), auto_wrap_policy=policy("gpt", True))
    fresh.load_state_dict(sd)
    with torch.no_grad():
        out["eval_reloaded"] = fresh(x, y)
    return to_numpy(out)


def _error_of(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test reads the type and the message
        return type(e).__name__, str(e)
    return None


def errors_worker():
    """Each bad input on 2 ranks: (exception type, message) or None if nothing was raised."""
    import torch.nn as nn

    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}

    def two_devices():
        m = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
        m[1].to("meta")
        FSDP(m)

    out["devices"] = _error_of(two_devices)
    out["hybrid_split"] = _error_of(lambda: hybrid_groups(3))
    out["hybrid_tile"] = _error_of(lambda: FSDP(make_model("mlp"), sharding_strategy=ShardingStrategy.HYBRID_SHARD,
                                                process_group=(dist.group.WORLD, dist.group.WORLD)))
    out["hybrid_none"] = _error_of(lambda: FSDP(make_model("mlp"), sharding_strategy=ShardingStrategy.HYBRID_SHARD))
    out["differs"] = _error_of(lambda: FSDP(TinyGPT(seed=rank), auto_wrap_policy=policy("gpt", True)))
    synced = FSDP(TinyGPT(seed=rank), auto_wrap_policy=policy("gpt", True), sync_module_states=True)
    ref = TinyGPT(seed=0).state_dict()
    out["synced_equals_rank0"] = all(torch.equal(v, ref[k]) for k, v in synced.state_dict().items())

    def frozen_mix():
        m = make_model("mlp")
        m.net[0].weight.requires_grad_(False)
        FSDP(m)

    out["frozen_mix"] = _error_of(frozen_mix)

    def optimizer_before_wrap():
        m = make_model("mlp")
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        fm = FSDP(m)
        x, y = batch("mlp", 0, rank, world)
        loss_of("mlp", fm, x, y).backward()
        opt.step()

    out["optimizer_before_wrap"] = _error_of(optimizer_before_wrap)

    m = FSDP(make_model("gpt"), auto_wrap_policy=policy("gpt", True))
    opt = make_opt("sgd", m.parameters())
    x, y = batch("gpt", 0, rank, world)

    def two_forwards_then_one_backward():  # allowed: the shards do not change in between
        (m(x, y) + m(x, y)).backward()

    out["two_forwards_ok"] = _error_of(two_forwards_then_one_backward)

    def step_between_forward_and_backward():
        m(x, y)  # its backward never runs...
        opt.step()  # ...the shards change (grads from above are still there)...
        m(x, y)  # ...and this forward would leave the first one's backward on new parameters

    out["forward_again"] = _error_of(step_between_forward_and_backward)
    return out
