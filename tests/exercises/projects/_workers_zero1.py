"""Rank functions for tests/exercises/projects/test_zero1.py: a ZeRO-1 beside torch's ZeroRedundancyOptimizer.

Two spawns of 3 ranks run two cases on the same seed and data (TinyGPT, its embedding tied to its output layer,
``pos_emb`` frozen; the seed and the batches drawn from the grading seed): :func:`torch_on_rank` as torch users
write ZeRO (``DistributedDataParallel`` averages the gradients, ``ZeroRedundancyOptimizer`` shards the
optimizer), no learner code in it; :func:`learner_on_rank` with the ``Zero1`` under test on the plain model, under
the project's rule (no ZeroRedundancyOptimizer, no torch FSDP) and on groups with a short timeout.

* ``pair``: ranks 0 and 1 (a group of 2; rank 2 waits), AdamW with weight decay, 3 steps;
* ``world``: all 3 ranks, SGD with momentum and weight decay, 3 steps.

Per rank and case: the losses and every parameter after every step, and the optimizer's memory: live
tensor bytes (``minifsdp.memory.census``, read once settled: :func:`settled_bytes`) after the first step and
``zero_grad(set_to_none=True)``, less those before the optimizer was built.  A ``Zero1`` that raises stops every
rank together, and the ranks hand back the exception (``{"raised": ...}``, with the learner's line).
"""

from __future__ import annotations

import importlib

import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

from minifsdp.classroom.course_remote import capture, to_bytes
from minifsdp.classroom.course_rules import enforce_here
from minifsdp.memory.census import live_tensor_bytes
from minifsdp.models import CharCorpus, GPTConfig, TinyGPT
from tests.exercises import learner_group

STEPS, BATCH = 3, 4
CASES = {
    "pair": ([0, 1], torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}),
    "world": ([0, 1, 2], torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01}),
}


def _model(seed: int = 0) -> TinyGPT:
    model = TinyGPT(GPTConfig.tiny(), seed=seed)
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


def _batches(members, seed: int) -> list:
    cfg, corpus = GPTConfig.tiny(), CharCorpus()
    rank, world = members.index(dist.get_rank()), len(members)
    return [corpus.batch(100 * seed + step, BATCH, cfg.block_size, rank, world) for step in range(STEPS)]


def torch_on_rank(seed: int) -> dict:
    """The oracle, on every rank (no learner code): {case: record} for the cases this rank is in."""
    groups = {name: dist.new_group(members) for name, (members, _, _) in CASES.items()}  # on every rank
    out = {}
    for name, (members, cls, kwargs) in CASES.items():
        if dist.get_rank() in members:
            group = groups[name]
            out[name] = _train(
                DistributedDataParallel(_model(seed), process_group=group),
                lambda ps, g=group, c=cls, k=kwargs: ZeroRedundancyOptimizer(ps, optimizer_class=c, process_group=g,
                                                                             **k),
                _batches(members, seed))
    return out


def learner_on_rank(name: str, seed: int) -> bytes:
    """The learner's ``Zero1``, on every rank: {case: record}, or {"raised": ...} once one rank's call raised."""
    enforce_here(("project-zero1",))
    groups = {case: learner_group(members) for case, (members, _, _) in CASES.items()}  # on every rank
    mod = capture(importlib.import_module, name)
    out, raised = {}, mod.get("raised")
    for case, (members, cls, kwargs) in CASES.items():
        if dist.get_rank() in members and raised is None:
            got = capture(_train, _model(seed), lambda ps, g=groups[case], c=cls, k=kwargs:
                          mod["value"].Zero1(ps, c, group=g, **k), _batches(members, seed))
            raised = got.get("raised")
            out[case] = got.get("value")
        stop = torch.tensor([float(raised is not None)])
        dist.all_reduce(stop)  # every rank, in the case or not, stops together
        if stop.item():
            return to_bytes({"raised": raised or {"type": "RuntimeError", "message": "another rank's Zero1 raised",
                                                  "where": ""}})
    return to_bytes(out)
