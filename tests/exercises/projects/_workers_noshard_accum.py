"""Rank functions for tests/exercises/projects/test_noshard_accum.py: gradient accumulation under no_sync.

Two spawns of 3 ranks; world size 3 (every rank), then world size 2 (ranks 0 and 1; rank 2 waits).  For
FULL_SHARD and SHARD_GRAD_OP, TinyGPT with its two blocks wrapped (three units), K = 3 micro-batches per rank
(drawn from the grading seed):

* the oracle (:func:`torch_on_rank`, a spawn that runs no learner code): torch FSDP1 run as torch's users
  accumulate (``no_sync()`` around the forward and backward of all but the last micro-batch, each loss divided
  by K); its sharded gradients and losses;

and in the learner's spawn (:func:`learner_on_rank`, groups with a short timeout):

* your ``accumulate`` on torch FSDP1 inside a ``MemoryTracker``, marked after each micro-batch once the count
  has settled (:func:`settle`): the gradients, the losses, the bytes held at each mark and the peak before it;
* your ``accumulate`` on our FSDP with the book's ring collectives, ``count_bytes()`` read after each
  micro-batch: the bytes sent (``count_bytes`` sees only the book's collectives, not gloo's), gradients, losses;
* at 2 ranks also your ``measure`` on fresh models: on torch FSDP1 (held, peak) and on ours (sent).

Every torch FSDP1 run comes first, then ours.  Every rank returns plain records; a learner's function that
raises stops every rank together, and the ranks hand back the exception (``{"raised": ...}``).
"""

from __future__ import annotations

import functools
import importlib
import time

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
from torch.distributed.fsdp import ShardingStrategy as TorchStrategy
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy as torch_wrap_policy

from minifsdp.classroom.course_remote import capture, describe, to_bytes
from minifsdp.comm.counting import count_bytes
from minifsdp.fsdp import FSDP
from minifsdp.fsdp.core.wrap import transformer_auto_wrap_policy
from minifsdp.memory.tracker import MemoryTracker
from minifsdp.models import Block, CharCorpus, GPTConfig, TinyGPT
from tests.exercises import learner_group

K, BATCH = 3, 2
STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP")
WORLDS = {3: [0, 1, 2], 2: [0, 1]}


def gpt_loss(model, batch):
    """The loss_fn the tests pass: TinyGPT returns its loss when given targets."""
    x, y = batch
    return model(x, y)


def _torch_model(strategy, group):
    return TorchFSDP(TinyGPT(GPTConfig.tiny(), seed=0), process_group=group, sharding_strategy=TorchStrategy[strategy],
                     device_id=torch.device("cpu"),
                     auto_wrap_policy=functools.partial(torch_wrap_policy, transformer_layer_cls={Block}))


def settle(tracker: MemoryTracker, quiet_s: float = 0.05, limit_s: float = 2.0) -> None:
    """Wait until the tracker's count has not changed for ``quiet_s``.

    gloo runs a collective on its own worker thread, which lets go of the collective's tensors a moment after
    the caller's ``wait()`` returned: right after a synced backward, the last reduce-scatter's input (the root
    unit's whole gradient) may still be alive, or already gone."""
    deadline = time.monotonic() + limit_s
    last, since = tracker.current_bytes, time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.005)
        if tracker.current_bytes != last:
            last, since = tracker.current_bytes, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            return


def _our_model(strategy, group):
    return FSDP(TinyGPT(GPTConfig.tiny(), seed=0), process_group=group, sharding_strategy=strategy, collectives="ring",
                auto_wrap_policy=functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block}))


def _grads(model) -> list[torch.Tensor]:
    return [p.grad.detach().clone() for p in model.parameters()]


def _torch_users_accumulate(model, micro) -> list[float]:
    """The oracle: gradient accumulation as torch FSDP1's users write it."""
    losses = []
    for k, batch in enumerate(micro):
        if k < len(micro) - 1:
            with model.no_sync():
                loss = gpt_loss(model, batch) / len(micro)
                loss.backward()
        else:
            loss = gpt_loss(model, batch) / len(micro)
            loss.backward()
        losses.append(loss.item())
    return losses


def _on_torch(mod, strategy, group, micro) -> dict:
    """Your ``accumulate`` on torch FSDP1 inside a ``MemoryTracker`` marked after each micro-batch: the bytes
    held at each mark and the peak since the one before, less the bytes when it started; ``found_at_exit``
    is the census's audit of the tracker's count (0: every byte it counted is there)."""
    model = _torch_model(strategy, group)
    units = [u._handle.flat_param._unpadded_unsharded_size.numel() for u in model.modules()
             if isinstance(u, TorchFSDP) and u._handle is not None]
    with MemoryTracker(model) as tracker:
        def after(k):
            settle(tracker)
            tracker.mark(f"after {k}")

        losses = mod.accumulate(model, micro, gpt_loss, after)
    rec = {"units": units, "losses": losses, "grads": _grads(model), "held": [], "peak": [],
           "audit": tracker.found_at_exit}
    start, begin = tracker.timeline[0][1], 0.0
    for name, end in [m for m in tracker.marks if m[0].startswith("after ")]:
        rec["held"].append(tracker.breakdown_at(name)["total"] - start)
        rec["peak"].append(max(b for t, b in tracker.timeline if begin <= t <= end) - start)
        begin = end
    return rec


def _on_ours(mod, strategy, group, micro) -> dict:
    """Your ``accumulate`` on our FSDP (the book's ring): ``count_bytes()`` read after each micro-batch."""
    model, totals = _our_model(strategy, group), []
    with count_bytes() as counter:
        losses = mod.accumulate(model, micro, gpt_loss, lambda k: totals.append(counter.sent))
    return {"losses": losses, "grads": _grads(model), "sent": [b - a for a, b in zip([0, *totals[:-1]], totals)],
            "units": [u._handle.layout.numel for u in model.modules() if isinstance(u, FSDP) and u._handle]}


def _micro_batches(members, seed: int) -> list:
    cfg, corpus = GPTConfig.tiny(), CharCorpus()
    rank, n = members.index(dist.get_rank()), len(members)
    return [corpus.batch(100 * seed + k, BATCH, cfg.block_size, rank, n) for k in range(K)]


def torch_on_rank(seed: int) -> dict:
    """The oracle, on every rank: {world size: {strategy: {"losses", "grads"}}} for the world sizes it is in."""
    groups = {n: dist.new_group(members) for n, members in WORLDS.items()}  # on every rank
    out = {}
    for n, members in WORLDS.items():
        if dist.get_rank() in members:
            for strategy in STRATEGIES:
                model, micro = _torch_model(strategy, groups[n]), _micro_batches(members, seed)
                out.setdefault(n, {})[strategy] = {"losses": _torch_users_accumulate(model, micro),
                                                   "grads": _grads(model)}
    return out


def _torch_runs(mod, strategy, group, members, seed) -> dict:
    micro = _micro_batches(members, seed)
    rec = {"torch": _on_torch(mod, strategy, group, micro)}
    if len(members) == 2:
        got = capture(mod.measure, _torch_model(strategy, group), micro, gpt_loss)
        if "raised" in got:
            rec["measure_not_done"] = describe(got["raised"])
        else:
            rec["measured_torch"] = got["value"]
    return rec


def _our_runs(mod, strategy, group, members, rec: dict, seed) -> None:
    micro = _micro_batches(members, seed)
    rec["ours"] = _on_ours(mod, strategy, group, micro)
    if len(members) == 2 and "measure_not_done" not in rec:
        got = capture(mod.measure, _our_model(strategy, group), micro, gpt_loss)
        if "raised" in got:
            rec["measure_not_done"] = describe(got["raised"])
        else:
            rec["measured_ours"] = got["value"]


def learner_on_rank(name: str, seed: int) -> bytes:
    """On every rank, the learner's functions: {world size: {strategy: record}} for the world sizes this rank is
    in, or {"raised": ...}.  Every torch FSDP1 run comes before any of ours, so no thread of our collectives is
    alive in the process while torch's bytes are counted."""
    from minifsdp.classroom.course_rules import enforce_here

    enforce_here(("project-noshard-accum",))
    groups = {n: learner_group(members) for n, members in WORLDS.items()}  # on every rank
    mod = capture(importlib.import_module, name)
    out, raised = {}, mod.get("raised")
    for phase in ("torch", "ours"):
        for n, members in WORLDS.items():  # world size 3 first: every rank calls your accumulate at once
            if dist.get_rank() in members and raised is None:
                for strategy in STRATEGIES:
                    if phase == "torch":
                        got = capture(_torch_runs, mod["value"], strategy, groups[n], members, seed)
                        out.setdefault(n, {})[strategy] = got.get("value")
                    else:
                        got = capture(_our_runs, mod["value"], strategy, groups[n], members, out[n][strategy], seed)
                    if "raised" in got:
                        raised = got["raised"]
                        break
            stop = torch.tensor([float(raised is not None)])
            dist.all_reduce(stop)  # every rank, in this world size or not, stops together
            if stop.item():
                return to_bytes({"raised": raised or {"type": "RuntimeError", "where": "",
                                                      "message": "another rank's accumulate raised"}})
    return to_bytes(out)
