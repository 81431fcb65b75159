"""Rank function for tests/exercises/projects/test_zero1.py: a ZeRO-1 beside torch's ZeroRedundancyOptimizer.

One spawn of 3 ranks runs two cases, each twice on the same seed and data (TinyGPT, its embedding tied
to its output layer, ``pos_emb`` frozen): once as torch users write ZeRO (``DistributedDataParallel``
averages the gradients, ``ZeroRedundancyOptimizer`` shards the optimizer), once with the ``Zero1``
under test on the plain model.

* ``pair``: ranks 0 and 1 (a group of 2; rank 2 waits), AdamW with weight decay, 3 steps;
* ``world``: all 3 ranks, SGD with momentum and weight decay, 3 steps.

Per rank and case: the losses and every parameter after every step, and the optimizer's memory: live
tensor bytes (``minifsdp.memory.census``, read once settled: :func:`settled_bytes`) after the first step and
``zero_grad(set_to_none=True)``, less those before the optimizer was built.  An unfinished ``Zero1`` raises
``NotImplementedError`` on every rank before any message, so the ranks return at once with ``{"not_done": ...}``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

from minifsdp.memory.census import live_tensor_bytes
from minifsdp.models import CharCorpus, GPTConfig, TinyGPT
from tests.exercises import impl_module

STEPS, BATCH = 3, 4
CASES = {
    "pair": ([0, 1], torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}),
    "world": ([0, 1, 2], torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01}),
}


def _model() -> TinyGPT:
    model = TinyGPT(GPTConfig.tiny(), seed=0)
    model.pos_emb.weight.requires_grad_(False)  # a frozen parameter: no gradient, no update
    return model


def settled_bytes(tries: int = 10) -> int:
    """The census once two readings in a row agree: gloo's worker thread lets go of a collective's tensors a
    moment after the caller's ``wait()`` has returned (the all-gather's buffer may still be alive, or gone)."""
    last = live_tensor_bytes()
    for _ in range(tries):
        now = live_tensor_bytes()
        if now == last:
            return now
        last = now
    return last


def _train(model, make_optimizer, batches) -> dict:
    """STEPS steps of ``model``; the optimizer is made by ``make_optimizer(params)`` after a census."""
    before = settled_bytes()
    opt = make_optimizer(model.parameters())
    rec = {"losses": [], "params": []}
    for step, (x, y) in enumerate(batches):
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        rec["losses"].append(loss.item())
        del loss
        if step == 0:
            rec["state_bytes"] = settled_bytes() - before
        rec["params"].append({n: p.detach().clone() for n, p in _named(model)})
    return rec


def _named(model):
    inner = model.module if isinstance(model, DistributedDataParallel) else model
    return inner.named_parameters()


def _case(mod, members, cls, kwargs, group) -> dict:
    cfg, corpus = GPTConfig.tiny(), CharCorpus()
    rank, world = members.index(dist.get_rank()), len(members)
    batches = [corpus.batch(step, BATCH, cfg.block_size, rank, world) for step in range(STEPS)]
    theirs = _train(DistributedDataParallel(_model(), process_group=group),
                    lambda ps: ZeroRedundancyOptimizer(ps, optimizer_class=cls, process_group=group, **kwargs),
                    batches)
    ours = _train(_model(), lambda ps: mod.Zero1(ps, cls, group=group, **kwargs), batches)
    return {"torch": theirs, "yours": ours}


def grade(impl: str) -> dict:
    """Runs on every rank; returns {case: {"torch": record, "yours": record}} for the cases this rank is in."""
    mod = impl_module("projects.zero1.zero1", impl)
    groups = {name: dist.new_group(members) for name, (members, _, _) in CASES.items()}  # on every rank
    out, not_done = {}, ""
    try:  # first a throwaway one on every rank: a stub stops here, before torch's run
        mod.Zero1(_model().parameters(), torch.optim.SGD, group=groups["world"], lr=0.1)
    except NotImplementedError as e:
        return {"not_done": f"{type(e).__name__}: {e}"}
    for name, (members, cls, kwargs) in CASES.items():
        if dist.get_rank() in members:
            try:
                out[name] = _case(mod, members, cls, kwargs, groups[name])
            except NotImplementedError as e:
                not_done = f"{type(e).__name__}: {e}"
        stop = torch.tensor([float(bool(not_done))])
        dist.all_reduce(stop)  # every rank, in the case or not, stops together
        if stop.item():
            return {"not_done": not_done or "another rank's Zero1 is not done"}
    return out
