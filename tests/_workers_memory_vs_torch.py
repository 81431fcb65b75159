"""Rank function for tests/test_memory_vs_torch.py: live tensor bytes per rank, ours against torch FSDP1.

The instrument is the census (``minifsdp.memory.census.live_tensor_bytes``: every storage Python can
reach, each counted once), which sees a copy the model no longer points to, such as the full-size
original parameters a flat-parameter layout could keep alive after flattening.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import gc
import threading
import time
import weakref

import torch
import torch.distributed as dist
import torch.nn as nn

from minifsdp.comm.collectives import torch_lets_go
from minifsdp.fsdp import FSDP, ShardingStrategy
from minifsdp.fsdp.backward_extras import BackwardExtras
from minifsdp.fsdp.core.wrap import transformer_auto_wrap_policy
from minifsdp.fsdp.torch_options import hybrid_groups
from minifsdp.memory.census import live_tensor_bytes
from minifsdp.models import Block, CharCorpus, GPTConfig, TinyGPT


def _odd_mlp() -> nn.Module:
    torch.manual_seed(0)  # flat sizes 78, 154, 36: no world size in {2, 3, 4} divides them all
    return nn.Sequential(nn.Linear(5, 13), nn.ReLU(), nn.Linear(13, 11), nn.ReLU(), nn.Linear(11, 3))


def _build(kind: str, config: str):
    if kind == "gpt":
        model = TinyGPT(getattr(GPTConfig, config)(), seed=0)
        return model, {Block}
    return _odd_mlp(), {nn.Linear}


def _wrap(side: str, model, layer_cls, strategy: str, orig: bool):
    groups = {}
    if strategy == "HYBRID_SHARD":
        groups = {"process_group": hybrid_groups(2)}
    if side == "ours":
        policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls=layer_cls)
        return FSDP(model, sharding_strategy=ShardingStrategy[strategy], auto_wrap_policy=policy,
                    use_orig_params=orig, **groups)
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
    from torch.distributed.fsdp import ShardingStrategy as TS
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy as torch_policy

    policy = functools.partial(torch_policy, transformer_layer_cls=layer_cls)
    return TorchFSDP(model, sharding_strategy=TS[strategy], auto_wrap_policy=policy, use_orig_params=orig,
                     device_id=torch.device("cpu"), **groups)


def _step(kind, model, opt, corpus, rank, world):
    if kind == "gpt":
        x, y = corpus.batch(0, 2, 32, rank, world)
        loss = model(x, y)
    else:
        g = torch.Generator().manual_seed(rank)
        loss = torch.nn.functional.mse_loss(model(torch.randn(4, 5, generator=g)), torch.randn(4, 3, generator=g))
    loss.backward()
    opt.step()
    opt.zero_grad()


def live_bytes_worker(kind: str, config: str, strategies: tuple, origs: tuple) -> dict:
    """{(side, strategy, orig): {"after_wrap": bytes, "at_rest": bytes}} above what was alive before building."""
    rank, world = dist.get_rank(), dist.get_world_size()
    corpus = CharCorpus() if kind == "gpt" else None
    out = {}
    for strategy in strategies:
        for orig in origs:
            for side in ("ours", "torch"):
                gc.collect()
                dist.barrier()
                base = live_tensor_bytes()
                model, layer_cls = _build(kind, config)
                model = _wrap(side, model, layer_cls, strategy, orig)
                after_wrap = live_tensor_bytes() - base
                opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
                with torch_lets_go() if side == "torch" else contextlib.nullcontext():
                    _step(kind, model, opt, corpus, rank, world)
                at_rest = live_tensor_bytes() - base
                out[(side, strategy, orig)] = {"after_wrap": after_wrap, "at_rest": at_rest}
                del model, opt
    return out


def slow_let_go_worker(hold_s: float) -> dict:
    """{slow: ours' bytes at rest after one NO_SHARD step} with gloo's worker thread as it is (False) and made
    slow to let go of a finished collective (True: each work, with its tensors, kept ``hold_s`` after it is
    done; ``hold_s`` longer than the step and the census take).  One unit: one all-reduce of its gradient,
    which ``zero_grad`` drops right after the step."""
    rank, world = dist.get_rank(), dist.get_world_size()
    real, kept, out = dist.all_reduce, [], {}

    def slow_to_let_go(*args, **kwargs):
        work = real(*args, **kwargs)
        kept.append(work)
        threading.Timer(hold_s, kept.remove, (work,)).start()
        return work

    for slow in (False, True):
        gc.collect()
        dist.barrier()
        base = live_tensor_bytes()
        model = FSDP(_odd_mlp(), sharding_strategy=ShardingStrategy.NO_SHARD)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        dist.all_reduce = slow_to_let_go if slow else real
        try:
            _step("mlp", model, opt, None, rank, world)
            out[slow] = live_tensor_bytes() - base
        finally:
            dist.all_reduce = real
        while kept:  # (the planted timers) before the next measurement
            time.sleep(0.01)
        del model, opt
    return out


def hidden_copy_worker() -> dict:
    """The census must see a full copy the model does not point to: the instrument's own failure test."""
    gc.collect()
    base = live_tensor_bytes()
    model = _wrap("ours", *_build("gpt", "tiny"), "FULL_SHARD", False)
    without = live_tensor_bytes() - base
    hidden = [p.detach().clone() for p in TinyGPT(GPTConfig.tiny(), seed=0).parameters()]
    keep = (lambda: hidden)  # reachable only through this closure
    with_copy = live_tensor_bytes() - base
    nbytes = sum(t.numel() * t.element_size() for t in keep())
    del model
    return {"without": without, "with": with_copy, "copy": nbytes}


def dropped_model_worker(cases: tuple) -> dict:
    """{case: bytes still alive after the user drops the model and optimizer}: 0 for ours ("+torch": torch FSDP1).

    A hook registered on a tensor lives in C++, out of the garbage collector's sight; a hook that
    holds its module makes a cycle nothing can collect, and every model built and dropped (a notebook,
    a sweep, a test suite) stays in memory.  Each case trains one step, exercising every hook ours
    registers, then drops everything and counts what is left.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    corpus = CharCorpus()
    out = {}
    for case in cases:
        strategy, _, variant = case.partition("+")
        gc.collect()
        base = live_tensor_bytes()
        model = TinyGPT(GPTConfig.tiny(), seed=0)
        if variant == "frozen":
            model.blocks[0].requires_grad_(False)  # a frozen unit: the reshard-only hook
        if strategy == "DDP":
            from minifsdp.ddp import DistributedDataParallel

            model = DistributedDataParallel(model)
        else:  # "+torch": torch FSDP1, which keeps it (its post-backward hook holds the unit from C++)
            model = _wrap("torch" if variant == "torch" else "ours", model, {Block}, strategy, variant == "orig")
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
        if variant == "no_sync":
            with model.no_sync():
                model(*corpus.batch(1, 2, 32, rank, world)).backward()
        _step("gpt", model, opt, corpus, rank, world)
        if variant == "summon":
            with FSDP.summon_full_params(model):
                pass
            model.state_dict()
        del model, opt
        gc.collect()
        out[case] = live_tensor_bytes() - base
    return out


def frees_worker(collectives: str, fault: str | None = None) -> dict:
    """When does a unit let go of its full buffers?  Checked at the moments torch FSDP2 frees them.

    * right after a unit's post-backward (a hook on its gradient leaf, registered after ours, runs
      next): the full gradient it reduce-scattered is dead (every storage handed to the
      reduce-scatter), its gradient leaf holds none, its all-gathered parameters are freed (0 bytes)
      and ``flat_param.grad`` is the reduced shard;
    * after the forward: every unit but the root has freed its all-gathered parameters (FSDP2's
      reshard after forward; its root keeps them for the backward, as ours);
    * after the backward: every unit, the root too.

    ``fault="keep_grad"`` plants the bug the checks exist for: something keeps the full gradient
    after its reduce-scatter (a reference in a list, as a stale ``pending`` entry would).
    Returns {"kept_grad_bytes", "grad_leaf_left", "gathered_after_post_backward", "shard_grad_ok",
    "after_forward": [bytes per unit, root first], "after_backward": [...], "reduce_scatters"}.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    model = _wrap("ours", TinyGPT(GPTConfig.tiny(), seed=0), {Block}, "FULL_SHARD", False)
    units = FSDP.fsdp_modules(model)
    handles = [u._handle for u in units]
    given = {id(h): [] for h in handles}  # weak references to every storage handed to a reduce-scatter
    report = {"kept_grad_bytes": 0, "grad_leaf_left": 0, "gathered_after_post_backward": 0, "shard_grad_ok": True,
              "reduce_scatters": 0}
    kept = []
    for h in handles:
        def reduce_scatter(out, inp, op="sum", group=None, async_op=False, _h=h, _orig=h.comm.reduce_scatter):
            given[id(_h)].append(weakref.ref(inp.untyped_storage()))
            if fault == "keep_grad":
                kept.append(inp)
            report["reduce_scatters"] += 1
            return _orig(out, inp, op=op, group=group, async_op=async_op)

        h.comm = copy.copy(h.comm)  # this unit's own, so that each unit's calls are told apart
        h.comm.reduce_scatter = reduce_scatter

        def after_post_backward(_leaf, _h=h):
            alive = [r() for r in given[id(_h)] if r() is not None]
            report["kept_grad_bytes"] += sum(st.nbytes() for st in alive)
            report["grad_leaf_left"] += _h.unsharded.grad is not None
            report["gathered_after_post_backward"] += _h.padded.untyped_storage().nbytes()
            g = _h.flat_param.grad
            report["shard_grad_ok"] &= g is not None and g.shape == _h.flat_param.shape

        h.unsharded.register_post_accumulate_grad_hook(after_post_backward)
    corpus = CharCorpus()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(2):  # the second step runs with every buffer already made once
        opt.zero_grad(set_to_none=True)
        loss = model(*corpus.batch(step, 2, 32, rank, world))
        report["after_forward"] = [h.padded.untyped_storage().nbytes() for h in handles]
        loss.backward()
        report["after_backward"] = [h.padded.untyped_storage().nbytes() for h in handles]
        opt.step()
    report["units"] = len(handles)
    return report


def frees_cases_worker(cases: tuple) -> list:
    """:func:`frees_worker` for each (collectives, fault) in ``cases``, in one spawn."""
    return [frees_worker(c, f) for c, f in cases]


class _Inner(nn.Linear):
    """A layer its parent calls twice in one forward (two graphs through one unit before one backward)."""


class _Twice(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.pre, self.inner, self.head = nn.Linear(8, 8), _Inner(8, 8), nn.Linear(8, 1)

    def forward(self, x):  # the first call's backward needs inner's weight (its input needs a gradient)
        return self.head(self.inner(torch.relu(self.inner(self.pre(x)))))


def _split_node(h):
    """The SplitWithSizesBackward0 node of a unit's current views (what backward_extras.py hooks), or None."""
    slot = h.layout.slots[0]
    node = getattr(slot.module.__dict__.get(slot.name), "grad_fn", None)
    while node is not None and node.name() != "SplitWithSizesBackward0":
        node = node.next_functions[0][0] if node.next_functions else None
    return node


def free_before_concat_worker(planted: bool) -> dict:
    """When autograd is about to concatenate a unit's parameter gradients, are its parameters freed?

    A pre-hook registered on the same node after ours runs after it and reads the gathered buffer's
    bytes; ``planted``: ours is switched off (the bug the check exists for: they stay until the
    post-backward).  Then a unit called twice per forward, trained with the early free and without
    it: the numbers must be the same bits (the second graph's node must not free what the first needs).
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    original = BackwardExtras.after_unshard  # (it only registers the free before the concat)
    if planted:
        BackwardExtras.after_unshard = lambda self, unit: None
    try:
        model = _wrap("ours", TinyGPT(GPTConfig.tiny(), seed=0), {Block}, "FULL_SHARD", False)
        handles = [u._handle for u in FSDP.fsdp_modules(model)]
        loss = model(*CharCorpus().batch(0, 2, 32, rank, world))
        seen = []
        for h in handles:
            node = _split_node(h)
            if node is not None:
                node.register_prehook(lambda _g, _h=h: seen.append(_h.padded.untyped_storage().nbytes()))
        loss.backward()
        out = {"at_concat": seen, "units": len(handles)}
        runs = {}
        for early in (True, False):
            BackwardExtras.after_unshard = original if early else (lambda self, unit: None)
            policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={_Inner})
            m = FSDP(_Twice(), auto_wrap_policy=policy)
            opt = torch.optim.SGD(m.parameters(), lr=0.1)
            g = torch.Generator().manual_seed(rank)
            for _ in range(2):
                opt.zero_grad()
                m(torch.randn(4, 8, generator=g)).pow(2).sum().backward()
                opt.step()
            runs[early] = [p.detach().clone() for p in m.parameters()] + [p.grad.clone() for p in m.parameters()]
        a, b = runs[True], runs[False]
        out["twice_same_bits"] = len(a) == len(b) > 0 and all(
            x.shape == y.shape and bool((x.view(torch.int32) == y.view(torch.int32)).all()) for x, y in zip(a, b))
        return out
    finally:
        BackwardExtras.after_unshard = original


def free_before_concat_cases_worker() -> list:
    """:func:`free_before_concat_worker` as shipped, then with the planted fault."""
    return [free_before_concat_worker(False), free_before_concat_worker(True)]
