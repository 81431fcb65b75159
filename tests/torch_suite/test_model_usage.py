"""How a model is used around FSDP: called twice in one forward, fed uneven batches, initialised by
``apply``, traversed, partly frozen.  Ports of torch's small FSDP1 test files
(test_fsdp_multiple_forward.py, test_fsdp_uneven.py, test_fsdp_apply.py, test_fsdp_traversal.py,
test_fsdp_freezing_weights.py), one group here to share one spawn.

- multiple forwards: a unit called twice in one forward trains as DDP does;
- uneven: ranks with different batch sizes, and parameter sizes no world size divides (2 and 3 ranks),
  train as DDP does;
- apply: ``model.apply(init_fn)`` on a wrapped model changes the full parameters as it changes a local
  model's; traversal: ``FSDP.fsdp_modules(model)`` (and ``root_only=True``) finds torch's units;
- freezing: a trunk frozen before wrapping (``requires_grad=False``) stays put, the head trains as
  DDP's [use_orig_params].
Oracles: DDP, the local model, torch FSDP1 (the unit count).  Tolerance: assert_close fp32 defaults
against DDP; bitwise against the local model.
"""

import pytest
import torch
import torch.nn as nn
from torch.distributed.fsdp import ShardingStrategy
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.testing._internal.common_fsdp import NestedWrappedModule

from tests._workers_fsdp import assert_bitwise
from tests.torch_suite import _harness as H
from tests.torch_suite import _workers as W


class _Twice(nn.Module):
    """A shared inner layer used twice per forward; torch-test-model interface (get_input, get_loss, run_backward)."""

    def __init__(self, wrap=None):
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.mid, self.out = nn.Linear(6, 8), nn.Linear(8, 8), nn.Linear(8, 5)
        if wrap is not None:
            self.mid = wrap(self.mid)

    def get_input(self, device):
        torch.manual_seed(1 + torch.distributed.get_rank())
        return (torch.randn(3 + 2 * torch.distributed.get_rank(), 6),)  # uneven batches: 3 and 5 rows

    def forward(self, x):
        return self.out(self.mid(torch.relu(self.mid(self.inp(x)))))

    def get_loss(self, inp, out):
        return out.square().mean()

    def run_backward(self, loss):
        loss.backward()


def _parity(api, build, steps=3, **kw):
    ref = DDP(build(None))
    ref_loss = W.train(ref, steps)
    fsdp = api.wrap(build(lambda m: api.wrap(m, **kw)), **kw)
    loss = W.train(fsdp, steps)
    torch.testing.assert_close(loss, ref_loss, msg=lambda m: f"loss vs DDP: {m}")
    got, want = api.full_params(fsdp), [p.detach() for p in ref.parameters()]
    assert len(got) == len(want), f"{len(got)} full parameters vs DDP's {len(want)}"
    for i, (a, b) in enumerate(zip(got, want)):
        torch.testing.assert_close(a, b, msg=lambda m, i=i: f"parameter {i} vs DDP: {m}")


def case_multiple_forward(api, strategy, orig):
    _parity(api, _Twice, sharding_strategy=strategy, use_orig_params=orig)


class _Odd(_Twice):
    """Linear(5, 3)-style sizes: no world size in {2, 3} divides its flat parameter."""

    def __init__(self, wrap=None):
        nn.Module.__init__(self)
        torch.manual_seed(0)
        self.inp, self.mid, self.out = nn.Linear(6, 5), nn.Linear(5, 5), nn.Linear(5, 3)
        if wrap is not None:
            self.mid = wrap(self.mid)

    def forward(self, x):
        return self.out(torch.relu(self.mid(self.inp(x))))


def case_uneven(api, strategy, orig):
    _parity(api, _Odd, sharding_strategy=strategy, use_orig_params=orig)


def _fill(m):
    if isinstance(m, nn.Linear):
        with torch.no_grad():
            m.weight.fill_(1.0)
            m.bias.fill_(0.5)


def case_apply(api, orig):
    local = W.local_model(NestedWrappedModule)
    local.apply(_fill)
    fsdp = api.init(NestedWrappedModule, dict(use_orig_params=orig))
    fsdp.apply(_fill)
    assert_bitwise(api.full_params(fsdp), [p.detach() for p in local.parameters()], "parameters after apply")


def case_traversal(api):
    fsdp = api.init(NestedWrappedModule)
    return {"all": len(api.FSDP.fsdp_modules(fsdp)), "root_only": len(api.FSDP.fsdp_modules(fsdp, root_only=True))}


class _TrunkHead(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.trunk = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 8))
        self.head = nn.Linear(8, 4)
        for p in self.trunk.parameters():
            p.requires_grad_(False)

    get_input, get_loss, run_backward = _Twice.get_input, _Twice.get_loss, _Twice.run_backward

    def forward(self, x):
        return self.head(self.trunk(x))


def case_freezing(api, orig):
    ref = DDP(_TrunkHead())
    ref_loss = W.train(ref, 3)
    model = _TrunkHead()
    frozen = [p.detach().clone() for p in model.trunk.parameters()]
    model.trunk = api.wrap(model.trunk, use_orig_params=orig)
    fsdp = api.wrap(model, use_orig_params=orig)
    loss = W.train(fsdp, 3)
    torch.testing.assert_close(loss, ref_loss, msg=lambda m: f"loss vs DDP: {m}")
    with api.FSDP.summon_full_params(fsdp):
        trunk = [p.detach().clone() for p in fsdp.module.trunk.parameters()]
        head = [p.detach().clone() for p in fsdp.module.head.parameters()]
    assert_bitwise(trunk, frozen, "the frozen trunk")
    for i, (a, b) in enumerate(zip(head, ref.module.head.parameters())):
        torch.testing.assert_close(a, b.detach(), msg=lambda m, i=i: f"head parameter {i} vs DDP: {m}")


CASES = W.Cases()
for _s in (ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP, ShardingStrategy.NO_SHARD):
    for _o in (False, True):
        CASES.add(case_multiple_forward, strategy=_s, orig=_o)
        CASES.add(case_uneven, strategy=_s, orig=_o)
        CASES.add(case_uneven, strategy=_s, orig=_o, world=3)
for _o in (False, True):
    CASES.add(case_apply, orig=_o)
    CASES.add(case_freezing, orig=_o)
CASES.add(case_traversal, vs_torch=(0, 0))

XFAIL: dict = {}
FAST = ("uneven:strategy=FULL_SHARD,orig=True@3", "freezing:orig=True")


@pytest.mark.parametrize("cid", H.params(CASES, XFAIL, FAST))
def test_case(cid):
    H.check(__name__, cid)
