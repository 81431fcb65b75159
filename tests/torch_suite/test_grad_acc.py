"""Port of torch's test_fsdp_grad_acc.py: accumulating gradients, inside and outside ``no_sync()``.

torch's check: on TransformerWithSharedParams (no BatchNorm: batch sizes vary), the gradients
accumulated over k batches (the data of one batch, permuted k times) equal the gradient of one
backward on their concatenation, and so do the summed losses; the last backward always syncs.
Two schedules: no_sync x3 / sync x3 / no_sync x3, and sync x3 / no_sync x3 / sync x3, for each
strategy, backward prefetch and use_orig_params.  Then an optimizer step must not fail.
Oracle: the same FSDP model's own single-batch gradient (a local reference, as torch's).
Tolerance: assert_close's fp32 defaults: summing 9 gradients differs from one batched sum in rounding.
"""

import contextlib
import itertools

import pytest
import torch
from torch.distributed.fsdp import BackwardPrefetch, ShardingStrategy
from torch.testing._internal.common_fsdp import TransformerWithSharedParams

from tests.torch_suite import _harness as H
from tests.torch_suite import _workers as W

SCHEDULES = {"nosync_first": ((True, 3), (False, 3), (True, 3)), "sync_first": ((False, 3), (True, 3), (False, 3))}


def _grads(model) -> list[torch.Tensor]:
    return [p.grad.detach().clone() for p in model.parameters() if p.grad is not None]


def case_grad_acc(api, schedule, strategy, prefetch, orig):
    model = api.init(TransformerWithSharedParams, dict(sharding_strategy=strategy, backward_prefetch=prefetch,
                                                       use_orig_params=orig), add_bn=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    inner = model.module
    first = inner.get_input(W.CPU)
    gen = torch.Generator().manual_seed(7)
    total = sum(n for _, n in SCHEDULES[schedule])
    batches = [first] + [tuple(t.view(-1)[torch.randperm(t.numel(), generator=gen)].view_as(t) for t in first)
                         for _ in range(total - 1)]
    for a, b in itertools.combinations(batches, 2):
        assert all(not torch.equal(x, y) for x, y in zip(a, b)), "two batches are equal: the check would be weak"
    whole = tuple(torch.cat(ts, dim=1) for ts in zip(*batches))  # T x B: the batch dimension is 1

    model.zero_grad()
    ref_loss = inner.get_loss(whole, model(*whole))
    ref_loss.backward()
    ref = _grads(model)

    model.zero_grad()
    losses, i = [], 0
    for use_no_sync, n in SCHEDULES[schedule]:
        with model.no_sync() if use_no_sync else contextlib.nullcontext():
            for _ in range(n):
                if i == total - 1:
                    break
                loss = inner.get_loss(batches[i], model(*batches[i]))
                loss.backward()
                losses.append(loss.detach())
                i += 1
    loss = inner.get_loss(batches[-1], model(*batches[-1]))
    loss.backward()
    losses.append(loss.detach())
    got = _grads(model)
    torch.testing.assert_close(sum(losses), ref_loss.detach(), msg=lambda m: f"summed losses: {m}")
    assert len(got) == len(ref), f"{len(got)} gradients vs {len(ref)} from the whole batch"
    for k, (g, r) in enumerate(zip(got, ref)):
        assert (g.dtype, g.shape) == (r.dtype, r.shape), f"gradient {k}: {g.dtype}{tuple(g.shape)} vs " \
                                                         f"{r.dtype}{tuple(r.shape)}"
        torch.testing.assert_close(g, r, msg=lambda m, k=k: f"gradient {k}: {m}")
    opt.step()


CASES = W.Cases()
for _sched in SCHEDULES:
    for _o in (False, True):
        for _s in (ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP, ShardingStrategy.NO_SHARD):
            for _p in (None, BackwardPrefetch.BACKWARD_PRE, BackwardPrefetch.BACKWARD_POST):
                CASES.add(case_grad_acc, schedule=_sched, strategy=_s, prefetch=_p, orig=_o)

XFAIL: dict = {}
FAST = ("grad_acc:schedule=nosync_first,strategy=FULL_SHARD,prefetch=BACKWARD_PRE,orig=True",)


@pytest.mark.parametrize("cid", H.params(CASES, XFAIL, FAST))
def test_case(cid):
    H.check(__name__, cid)
