"""Port of torch's test_fsdp_misc.py: the assorted checks that run on CPU.

What torch's file checks, and how here:
- a namedtuple passes through the forward, its tensors get the pre-backward hook and backward runs;
- a model whose second output goes unused in the loss from the third step on trains as the local
  model does, every unit freed after each backward [strategy];
- SGD applied inside the backward (``_apply_optimizer_in_backward``, use_orig_params) gives the same
  parameters as SGD after it, and leaves no gradient behind;
- a unit whose output takes no part in the loss (or that is not called) gets no gradient [called or
  not x strategy];
- a module without parameters wraps and runs;
- nested units built with different ``use_orig_params`` or ``limit_all_gathers`` are refused at the
  first forward with torch's ValueError [attribute];
- on 1 rank FULL_SHARD, SHARD_GRAD_OP and the default warn that NO_SHARD is used; NO_SHARD does not
  [strategy];
- ``sync_module_states=True`` makes rank 1's parameters and buffers rank 0's (torch FSDP1 needs a GPU
  for it: skipped as torch's failure);
- a module's own ``__setattr__`` is called when FSDP switches its parameters between views, as
  torch's default does (torch's ``_FSDP_USE_UNSAFE_SETATTR`` unset) [use_orig_params].
Not ported (GPU placement: ``device_id`` moves and mismatches, CPU-offload devices, the CPU-init
warning, multi-device modules, training-device mismatches): on CPU there is nothing to move.
Oracles: the local model, SGD after the backward, torch FSDP1 (error types, warnings, which gradients
exist).  Tolerance: bitwise against the local model (every rank sees the same input, so FSDP's average
of equal gradients is exact) and between the two SGDs.
"""

import warnings
from collections import namedtuple

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import ShardingStrategy
from torch.distributed.fsdp.wrap import always_wrap_policy
from torch.distributed.optim import _apply_optimizer_in_backward
from torch.testing._internal.common_fsdp import NestedWrappedModule

from tests._workers_fsdp import assert_bitwise
from tests.torch_suite import _harness as H
from tests.torch_suite import _workers as W

STRATEGIES = (ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP, ShardingStrategy.NO_SHARD)
_Quad = namedtuple("_Quad", ["a", "b", "c", "d"])


class _Identity(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(10, 10)

    def forward(self, x):
        return x


def case_namedtuple(api):
    fsdp = api.wrap(_Identity())
    t = torch.ones(1, requires_grad=True)
    out = fsdp(_Quad(t, t, t, t))
    assert type(out) is _Quad, f"the output is a {type(out).__name__}, not the namedtuple passed in"
    hooked = [len(x._backward_hooks or {}) > 0 for x in out]
    assert all(hooked), f"tensors of the output without FSDP's pre-backward hook: {hooked}"


class _TwoOutputs(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin1, self.lin2 = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        return self.lin1(x), self.lin2(x)


def _resident(api, unit) -> bool:
    h = unit._handle
    if api.ours:
        return h.frees and h.padded.untyped_storage().size() > 0
    return h.uses_sharded_strategy and h.flat_param._full_param_padded.untyped_storage().size() > 0


def case_not_all_outputs_used(api, strategy):
    local = _TwoOutputs()
    model = _TwoOutputs()
    model.lin1 = api.wrap(model.lin1, sharding_strategy=strategy)
    fsdp = api.wrap(model, sharding_strategy=strategy)
    units = [u for u in api.FSDP.fsdp_modules(fsdp) if u._handle is not None]
    opts = [torch.optim.SGD(m.parameters(), lr=1e-3) for m in (fsdp, local)]
    losses = []
    for step in range(6):
        x = torch.ones(4)
        pair = []
        for m in (fsdp, local):
            a, b = m(x)
            loss = (a @ b).sum() if step < 2 else a.sum()  # from step 2 on, lin2's output is not used
            loss.backward()
            pair.append(loss.detach())
        resident = [_resident(api, u) for u in units]
        assert not any(resident), f"step {step}: units still gathered after the backward: {resident}"
        for opt in opts:
            opt.step()
            opt.zero_grad()
        assert_bitwise(pair[0], pair[1], f"step {step} loss vs the local model")
        assert_bitwise(api.full_params(fsdp), [p.detach() for p in local.parameters()], f"step {step} parameters")
        losses.append(pair[0])
    return losses


class _AB(nn.Module):
    def __init__(self, use_b: bool = True):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.use_b = nn.Linear(10, 10), nn.Linear(10, 10), use_b

    def forward(self, x, y):
        out = self.a(x)
        return (out, self.b(y)) if self.use_b else out


def case_optimizer_in_backward(api):
    after = api.wrap(_AB(), auto_wrap_policy=always_wrap_policy, use_orig_params=True)
    inside = api.wrap(_AB(), auto_wrap_policy=always_wrap_policy, use_orig_params=True)
    _apply_optimizer_in_backward(torch.optim.SGD, inside.parameters(), {"lr": 0.03})
    opt = torch.optim.SGD(after.parameters(), lr=0.03)
    before = api.full_params(inside)
    torch.manual_seed(1 + dist.get_rank())
    inp = torch.randn(10, 10)
    for m in (after, inside):
        sum(o.sum() for o in m(inp, inp)).backward()
    opt.step()
    opt.zero_grad()
    got, want = api.full_params(inside), api.full_params(after)
    assert len(got) == len(want) == len(before), f"{len(got)}, {len(want)}, {len(before)} parameters"
    assert all(not torch.equal(a, b) for a, b in zip(got, before)), "SGD in the backward left a parameter as it was"
    assert_bitwise(got, want, "SGD in the backward vs SGD after it")
    left = [p.grad is not None for p in inside.parameters()]
    assert not any(left), f"gradients left behind by SGD in the backward: {left}"
    return got


def case_no_grad_unit(api, use_b, strategy):
    fsdp = api.wrap(_AB(use_b), sharding_strategy=strategy, auto_wrap_policy=always_wrap_policy)
    torch.manual_seed(1 + dist.get_rank())
    x, y = torch.randn(10, 10), torch.randn(10, 10)
    seen = []
    for _ in range(4):
        out = fsdp(x, y)
        (out[0] if use_b else out).sum().backward()
        a = [p.grad is not None for p in fsdp.module.a.parameters()]
        b = [p.grad is not None for p in fsdp.module.b.parameters()]
        assert all(a) and a, f"unit a has parameters without a gradient: {a}"
        assert not any(b), f"unit b got a gradient although its output is not in the loss: {b}"
        seen.append((a, b))
    return seen


def case_no_params(api):
    fsdp = api.wrap(nn.ReLU())
    x = torch.randn(3, 4)
    assert_bitwise(fsdp(x), torch.relu(x), "ReLU under FSDP")


def case_homogeneous(api, attr):
    model = W.local_model(NestedWrappedModule)
    model.module[1] = api.wrap(model.module[1], **{attr: False})
    fsdp = api.wrap(model, **{attr: True})
    try:
        fsdp(*fsdp.module.get_input(W.CPU))
    except ValueError as e:
        assert str(e).startswith("Expects one homogeneous value for") and attr in str(e), f"message: {e}"
        return "ValueError"
    raise AssertionError(f"units with different {attr} trained without an error")


def case_world_size_1_warning(api, strategy):
    kw = {} if strategy == "default" else dict(sharding_strategy=strategy)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        api.wrap(nn.Linear(3, 3), **kw)
    warned = any(issubclass(w.category, UserWarning) and "NO_SHARD" in str(w.message) for w in seen)
    assert warned == (strategy != ShardingStrategy.NO_SHARD), f"warned about NO_SHARD: {warned}"
    return warned


class _RankSeeded(nn.Module):
    def __init__(self, rank):
        super().__init__()
        torch.manual_seed(rank)
        self.lin = nn.Linear(10, 10, bias=False)
        self.register_buffer("buffer", torch.ones(1) * rank)


def case_sync_module_states(api):
    fsdp = api.wrap(_RankSeeded(dist.get_rank()), sync_module_states=True)
    with api.FSDP.summon_full_params(fsdp):
        mine = [t.detach().clone() for t in [*fsdp.parameters(), *fsdp.buffers()]]
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    ref = _RankSeeded(0)
    assert_bitwise(mine, [t.detach() for t in [*ref.parameters(), *ref.buffers()]], "rank 0's module states")
    for r, theirs in enumerate(everyone):
        assert_bitwise(theirs, mine, f"rank {r}'s module states")


def case_setattr_override(api, orig):
    calls = []

    class SetattrLinear(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.weight = nn.Parameter(torch.randn(5, 5))

        def forward(self, x):
            return x @ self.weight

        def __setattr__(self, name, value):
            calls.append(name)
            return super().__setattr__(name, value)

    fsdp = api.wrap(SetattrLinear(), use_orig_params=orig)
    calls.clear()
    fsdp(torch.randn(8, 5))
    assert calls, "the module's __setattr__ was not called while FSDP switched its parameter's views"


CASES = W.Cases()
CASES.add(case_namedtuple)
for _s in STRATEGIES:
    CASES.add(case_not_all_outputs_used, strategy=_s, vs_torch=(0, 0))
CASES.add(case_optimizer_in_backward, vs_torch=(0, 0))
for _b in (True, False):
    for _s in (ShardingStrategy.NO_SHARD, ShardingStrategy.FULL_SHARD):
        CASES.add(case_no_grad_unit, use_b=_b, strategy=_s, vs_torch=(0, 0))
CASES.add(case_no_params)
for _a in ("use_orig_params", "limit_all_gathers"):
    CASES.add(case_homogeneous, attr=_a, vs_torch=(0, 0))
for _s in ("default", ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP, ShardingStrategy.NO_SHARD):
    CASES.add(case_world_size_1_warning, strategy=_s, world=1, vs_torch=(0, 0))
CASES.add(case_sync_module_states)
for _o in (False, True):
    CASES.add(case_setattr_override, orig=_o)

XFAIL: dict = {}
FAST = ("not_all_outputs_used:strategy=FULL_SHARD",)


@pytest.mark.parametrize("cid", H.params(CASES, XFAIL, FAST))
def test_case(cid):
    H.check(__name__, cid)
