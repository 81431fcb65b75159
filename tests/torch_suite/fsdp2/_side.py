"""Rank side of the FSDP2 port: torch's ``fully_shard`` or ours behind one set of names, and torch's checks.

The batch runner is the FSDP1 port's (``tests/torch_suite/_workers.run_batch``: each case on each side, on every
rank, errors as results); :class:`Cases2` registers a case so that it receives a :class:`Side2` instead of the
FSDP1 side.  Everything a case passes to ``fully_shard`` besides the module (``MixedPrecisionPolicy``,
``OffloadPolicy``, meshes) is torch's own, as code written for torch passes it.
"""

from __future__ import annotations

import contextlib
import copy
import functools
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.distributed.fsdp as tfsdp
import torch.nn as nn
from torch.distributed._composable import replicate
from torch.distributed.tensor import DTensor
from torch.testing._internal.common_fsdp import check_sharded_parity
from torch.testing._internal.common_utils import TestCase

import minifsdp.fsdp2 as ours
import minifsdp.fsdp2.core.param_group as ours_group
from tests.torch_suite import _harness as H
from tests.torch_suite import _workers as W

TC = TestCase()  # torch's assertEqual: tensors within dtype-based tolerances, the rest by ==


def _not_built(name: str):
    def call(*args, **kwargs):
        raise NotImplementedError(f"minifsdp.fsdp2 has no {name}")
    return call


class Side2:
    """torch's ``fully_shard`` (``ours=False``) or minifsdp's, with the other public names of the API."""

    def __init__(self, ours_side: bool):
        self.ours = ours_side
        self.name = "ours" if ours_side else "torch"
        src = ours if ours_side else tfsdp
        self.fully_shard = src.fully_shard
        self.FSDPModule = src.FSDPModule
        self.register_fsdp_forward_method = getattr(src, "register_fsdp_forward_method", None) or \
            _not_built("register_fsdp_forward_method")


class Cases2(W.Cases):
    """``id -> Case`` whose functions take a :class:`Side2` (the runner hands them the FSDP1 side)."""

    def add(self, fn, *, world: int = 2, vs_torch=None, **params) -> str:
        @functools.wraps(fn)
        def run(side, **kw):
            return fn(Side2(side.ours), **kw)
        return super().add(run, world=world, vs_torch=vs_torch, **params)


def check(module: str, cid: str) -> None:
    res = H.result(module, cid)
    if res.get("torch"):
        pytest.skip(f"torch FSDP2 fails on CPU: {res['torch']}")
    if res.get("ours"):
        pytest.fail(f"{res['ours']}\n{res.get('ours_tb', '')}", pytrace=False)


# ---------------------------------------------------------------- torch's checks
def assert_equal(a, b, msg: str = "") -> None:
    TC.assertEqual(a, b, msg=msg)


def sharded_parity(ref: nn.Module, model: nn.Module, prefixes_to_ignore: tuple = ()) -> None:
    """torch's ``check_sharded_parity``: every parameter a DTensor whose local rows (and gradient's) equal the
    replicated reference's, distributed with the same placements."""
    check_sharded_parity(TC, ref, model, prefixes_to_ignore=prefixes_to_ignore)


def replicated(model: nn.Module) -> nn.Module:
    """torch's reference: a deep copy under torch's ``replicate()`` (DDP as a composable API)."""
    return replicate(copy.deepcopy(model))


def all_reduce_grads(model: nn.Module, op=dist.ReduceOp.AVG, group=None) -> None:
    """The reference's gradient sync by hand, as torch's tests do for an unwrapped reference."""
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad, op=op, group=group)


def broadcast_params(model: nn.Module) -> None:
    with torch.no_grad():
        for p in model.parameters():
            dist.broadcast(p, src=0)


def train_parity(ref, ref_optim, model, optim, inputs, iters: int, *, set_to_none_alternate: bool = True,
                 loss_fn=lambda out: out.sum()) -> list:
    """torch's loop: for each iteration, zero grads (alternating ``set_to_none``), forward, backward, step, on the
    reference then the sharded model; losses equal with torch's tolerances every iteration."""
    losses = []
    for it in range(iters):
        pair = []
        inp = inputs(it)
        for m, o in ((ref, ref_optim), (model, optim)):
            o.zero_grad(set_to_none=(it % 2 == 0) if set_to_none_alternate else True)
            pair.append(loss_fn(m(*inp)))
            pair[-1].backward()
            o.step()
        assert_equal(pair[0], pair[1], msg=f"iteration {it}: loss vs the replicated reference")
        losses.append(pair[1].detach())
    return losses


def is_dtensor(p) -> bool:
    return isinstance(p, DTensor)


@contextlib.contextmanager
def record_events(api: Side2, events: list, kinds=("unshard", "reshard", "post_backward")):
    """torch's event recorder for its own parameter groups, on this side's: ``(kind, module names, training state
    name)`` for each unshard that is not a no-op, each reshard that is not a forward no-op, each post-backward."""
    if api.ours:
        cls = ours_group.FSDPParamGroup

        def pending(g):
            return g._gathered is None and g.sharded_state.name != "UNSHARDED"

        def fqn(g):
            return g.module_fqn

        def state(g):
            return g.training_state.name

        def keeps(g):
            return not g.reshard_after_forward
    else:
        from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup as cls

        def pending(g):
            return g._all_gather_result is None and g._sharded_state.name != "UNSHARDED"

        def fqn(g):
            return g._module_fqn

        def state(g):
            return g._training_state.name

        def keeps(g):
            return not g._reshard_after_forward
    orig = {k: getattr(cls, k) for k in kinds}

    def unshard(self, *a, **k):
        if pending(self):
            events.append(("unshard", fqn(self), state(self)))
        return orig["unshard"](self, *a, **k)

    def reshard(self, *a, **k):
        if state(self) == "FORWARD" and keeps(self):
            return None
        events.append(("reshard", fqn(self), state(self)))
        return orig["reshard"](self, *a, **k)

    def post_backward(self, *a, **k):
        out = orig["post_backward"](self, *a, **k)
        events.append(("post_backward", fqn(self), state(self)))
        return out

    fns = {"unshard": unshard, "reshard": reshard, "post_backward": post_backward}
    with contextlib.ExitStack() as stack:
        for k in kinds:
            stack.enter_context(mock.patch.object(cls, k, fns[k]))
        yield events
