"""Port of torch's test_fsdp_input.py: a wrapped model called with a list or a dict instead of a tensor.

What torch's file checks (on one GPU), and how here (2 ranks, CPU):
- a model whose forward takes ``[x]`` or ``{"in": x}`` trains under FSDP: 5 SGD steps with an input that
  requires grad; here also against DDP (losses, final parameters) [container x strategy];
- FSDP hands the forward the caller's own container, not a copy: what the forward appends to the list
  or adds to the dict is there after the call [container].  (The torch FSDP1 installed here, 2.13 on
  CPU, passes the forward a copy of the list or dict: these 2 cases are skipped as torch's failures.)
Oracles: DDP (losses and parameters), torch FSDP1 (the same losses, the same container seen after the
call).  Tolerance: assert_close fp32 defaults against DDP (DDP all-reduces where FSDP reduce-scatters);
bitwise against torch FSDP1.
"""

import pytest
import torch
import torch.nn as nn
from torch.distributed.fsdp import ShardingStrategy
from torch.nn.parallel import DistributedDataParallel as DDP

from tests.torch_suite import _harness as H
from tests.torch_suite import _workers as W


class _TakesContainer(nn.Module):
    """``forward([x])`` or ``forward({"in": x})``; with ``mutate``, it also adds an entry to what it was given."""

    def __init__(self, mutate: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.layer, self.mutate = nn.Linear(4, 4), mutate

    def forward(self, inp):
        if isinstance(inp, list):
            if self.mutate:
                inp.append(torch.zeros(4, 4))
            x = inp[0]
        else:
            assert isinstance(inp, dict), f"expected a list or a dict, got {type(inp).__name__}"
            if self.mutate:
                inp["added"] = torch.zeros(4, 4)
            x = inp["in"]
        return self.layer(x)


def _pack(container: str, x: torch.Tensor):
    return [x] if container == "list" else {"in": x}


def case_input_type(api, container, strategy):
    ddp = DDP(_TakesContainer())
    fsdp = api.wrap(_TakesContainer(), sharding_strategy=strategy)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (fsdp, ddp)]
    torch.manual_seed(1 + torch.distributed.get_rank())
    losses = []
    for step in range(5):
        x = torch.rand(64, 4)
        pair = []
        for m, opt in zip((fsdp, ddp), opts):
            inp = x.clone().requires_grad_(True)
            loss = m(_pack(container, inp)).sum()
            loss.backward()
            assert inp.grad is not None, "the input's gradient did not come back through the container"
            opt.step()
            opt.zero_grad()
            pair.append(loss.detach())
        torch.testing.assert_close(pair[0], pair[1], msg=lambda m, s=step: f"step {s} loss vs DDP: {m}")
        losses.append(pair[0])
    got, want = api.full_params(fsdp), [p.detach() for p in ddp.parameters()]
    assert len(got) == len(want), f"{len(got)} parameters vs DDP's {len(want)}"
    for i, (a, b) in enumerate(zip(got, want)):
        torch.testing.assert_close(a, b, msg=lambda m, i=i: f"parameter {i} vs DDP: {m}")
    return losses


def case_input_identity_preserved(api, container):
    fsdp = api.wrap(_TakesContainer(mutate=True))
    inp = _pack(container, torch.rand(64, 4))
    fsdp(inp)
    if container == "list":
        assert len(inp) == 2, f"the list the forward appended to has {len(inp)} entries after the call, not 2"
    else:
        assert "added" in inp, f"the key the forward added is not in the caller's dict: {sorted(inp)}"
    return sorted(inp) if container == "dict" else len(inp)


CASES = W.Cases()
for _c in ("list", "dict"):
    for _s in (ShardingStrategy.FULL_SHARD, ShardingStrategy.NO_SHARD):
        CASES.add(case_input_type, container=_c, strategy=_s, vs_torch=(0, 0))
    CASES.add(case_input_identity_preserved, container=_c, vs_torch=(0, 0))

XFAIL: dict = {}
FAST = ("input_type:container=dict,strategy=FULL_SHARD",)


@pytest.mark.parametrize("cid", H.params(CASES, XFAIL, FAST))
def test_case(cid):
    H.check(__name__, cid)
