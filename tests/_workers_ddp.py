"""Rank functions for tests/test_ddp.py (module level, so spawn can pickle them).

One spawn per world size runs every variant: torch's DDP and ours are trained
side by side in the same process, on the same data, and the parent gets back
only numbers (max |param difference| per variant) to assert on.
"""

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from minifsdp.ddp import DistributedDataParallel
from minifsdp.models import MLP, CharCorpus, TinyGPT

STEPS = 5
VARIANTS = [("torch", "reverse"), ("torch", "torch"), ("ring", "reverse"), ("ring", "torch"), ("textbook", "torch")]
_CORPUS = None


def _corpus():
    global _CORPUS
    if _CORPUS is None:
        _CORPUS = CharCorpus()
    return _CORPUS


def make_model(name):
    return TinyGPT(seed=0) if name == "gpt" else MLP(seed=0)


def loss_on(model, name, step, rank, world_size, micro=0):
    """The loss of ``model`` (plain or wrapped) on this rank's slice of the global batch of ``step``."""
    if name == "gpt":
        x, y = _corpus().batch(1000 * micro + step, 4, 32, rank, world_size)
        return model(x, y)
    x, y = _mlp_batch(step, micro, rank, world_size)
    return F.mse_loss(model(x), y)


def _mlp_batch(step, micro, rank, world_size):
    g = torch.Generator().manual_seed(10_000 + 1000 * micro + step)
    x = torch.randn(8 * world_size, 16, generator=g)
    y = torch.randn(8 * world_size, 8, generator=g)
    return x[rank::world_size].contiguous(), y[rank::world_size].contiguous()


def make_opt(params, kind):
    return torch.optim.SGD(params, lr=0.1) if kind == "sgd" else torch.optim.AdamW(params, lr=1e-2)


def max_diff(a: nn.Module, b: nn.Module) -> float:
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))


def train_side_by_side(name, opt_kind, rank, ws):
    """torch DDP and the variants of ours, same data; returns {variant: max diff after STEPS}."""
    models = {"torch": TorchDDP(make_model(name))}
    for coll, layout in VARIANTS:
        models[f"{coll}/{layout}"] = DistributedDataParallel(make_model(name), collectives=coll, bucket_layout=layout)
    opts = {k: make_opt(m.parameters(), opt_kind) for k, m in models.items()}
    for step in range(STEPS):
        for k, m in models.items():
            opts[k].zero_grad()
            loss_on(m, name, step, rank, ws).backward()
            opts[k].step()
    diffs = {k: max_diff(models["torch"].module, m.module) for k, m in models.items() if k != "torch"}
    # the textbook ring (comm/ring.py) and the tuned one add in the same order: the same bits at any N
    diffs["textbook/torch vs ring/torch"] = max_diff(models["ring/torch"].module, models["textbook/torch"].module)
    return diffs


def no_sync_parity(rank, ws):
    """2 micro-batches per step (the first under no_sync) with torch's DDP and ours; max diff after 3 steps."""
    models = {"torch": TorchDDP(make_model("gpt")),
              "ours": DistributedDataParallel(make_model("gpt"), bucket_layout="torch")}
    opts = {k: make_opt(m.parameters(), "adamw") for k, m in models.items()}
    for step in range(3):
        for k, m in models.items():
            opts[k].zero_grad()
            with m.no_sync():
                loss_on(m, "gpt", step, rank, ws, micro=0).backward()
            loss_on(m, "gpt", step, rank, ws, micro=1).backward()
            opts[k].step()
    return max_diff(models["torch"].module, models["ours"].module)


def oracle_diff(rank, ws):
    """Ours (SGD) against one plain model trained on the whole global batch, in this process."""
    ours = DistributedDataParallel(make_model("gpt"))
    plain = make_model("gpt")
    o1, o2 = make_opt(ours.parameters(), "sgd"), make_opt(plain.parameters(), "sgd")
    for step in range(STEPS):
        o1.zero_grad()
        loss_on(ours, "gpt", step, rank, ws).backward()
        o1.step()
        o2.zero_grad()
        _global_loss(plain, step, ws).backward()
        o2.step()
    return max_diff(ours.module, plain)


def _global_loss(plain, step, ws):
    x, y = _corpus().batch(step, 4 * ws, 32, 0, 1)  # the same rows as the ranks' slices, all of them
    return plain(x, y)


def parity_suite(with_extras):
    rank, ws = dist.get_rank(), dist.get_world_size()
    out = {"train": {}, "no_sync": no_sync_parity(rank, ws), "oracle": oracle_diff(rank, ws)}
    for name in ("gpt", "mlp"):
        for opt_kind in ("sgd", "adamw"):
            out["train"][(name, opt_kind)] = train_side_by_side(name, opt_kind, rank, ws)
    if with_extras:
        out.update(extras(rank, ws))
    return out


def extras(rank, ws):
    """Small buckets + trace, frozen params, and the two bad inputs."""
    res = {}
    # Many small buckets on the GPT: still bitwise with torch at 2 ranks; the trace shows overlap.
    torch_ddp = TorchDDP(make_model("gpt"))
    ours = DistributedDataParallel(make_model("gpt"), bucket_cap_mb=0.01, trace=True)
    oa, ob = make_opt(torch_ddp.parameters(), "adamw"), make_opt(ours.parameters(), "adamw")
    for step in range(3):
        for m, o in ((torch_ddp, oa), (ours, ob)):
            o.zero_grad()
            loss_on(m, "gpt", step, rank, ws).backward()
            o.step()
    res["small_buckets_diff"] = max_diff(torch_ddp.module, ours.module)
    res["buckets"] = ours.buckets
    res["events"] = ours.bucket_events
    res["window"] = ours.backward_window
    res["names"] = [n for n, _ in ours.module.named_parameters()]

    # Frozen parameters (no grad) are left out of the buckets, as torch does.
    def frozen():
        m = make_model("gpt")
        m.pos_emb.weight.requires_grad_(False)
        return m
    torch_ddp, ours = TorchDDP(frozen()), DistributedDataParallel(frozen())
    oa, ob = make_opt(torch_ddp.parameters(), "sgd"), make_opt(ours.parameters(), "sgd")
    for step in range(2):
        for m, o in ((torch_ddp, oa), (ours, ob)):
            o.zero_grad()
            loss_on(m, "gpt", step, rank, ws).backward()
            o.step()
    res["frozen_diff"] = max_diff(torch_ddp.module, ours.module)
    res["frozen_in_buckets"] = any("pos_emb.weight" in b["params"] for b in ours.buckets)

    # Bad input 1: rank 1 builds a different model.
    try:
        DistributedDataParallel(MLP((16, 32 + rank, 8), seed=0))
        res["shape_error"] = None
    except ValueError as e:
        res["shape_error"] = str(e)

    # Bad input 2: a parameter the loss never uses.
    m = make_model("mlp")
    m.unused = nn.Linear(2, 2)
    ddp = DistributedDataParallel(m)
    try:
        loss_on(ddp, "mlp", 0, rank, ws).backward()
        res["unused_error"] = None
    except RuntimeError as e:
        res["unused_error"] = str(e)
    return res
