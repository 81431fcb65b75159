"""Port of torch's test_fully_shard_grad_scaler.py: ``torch.amp.GradScaler`` over sharded gradients.

torch's check (two linears, one group each and the root): after ``scaler.scale(loss).backward()``, with or without
an inf planted in rank 1's local gradient, ``unscale_`` finds the inf on every rank (the found-inf flag is reduced
over the mesh), the gradients are divided by the scale, ``step`` leaves the optimizer state untouched when an inf
was found (and changes it otherwise), and ``update`` backs the scale off exactly then.  torch plants the inf on the
rank whose device index is 1; on CPU that index is None, so here the inf goes to rank 1 by rank.  (The tensor
parallel variant is left out.)
"""

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.amp.grad_scaler import GradScaler, OptState

from tests.torch_suite.fsdp2 import _side as S


def case_gradient_scaler(api, has_inf):
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(4, 4, bias=False) for _ in range(2)])
    for layer in model:
        api.fully_shard(layer)
    api.fully_shard(model)
    loss = model(torch.randn(4, 4)).sum()
    scaler = GradScaler("cpu", init_scale=2.0, enabled=True)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    scaler.scale(loss).backward()
    inv_scale = scaler._scale.double().reciprocal().float()
    first = opt.param_groups[0]["params"][0]
    if has_inf and dist.get_rank() == 1:
        first.grad.to_local()[0, 0].fill_(float("inf"))
    initial_grad = first.grad.to_local().clone()
    scaler.unscale_(opt)
    for found_inf in scaler._per_optimizer_states[id(opt)]["found_inf_per_device"].values():
        S.assert_equal(found_inf, torch.tensor(float(has_inf)))
    assert scaler._per_optimizer_states[id(opt)]["stage"].value == OptState.UNSCALED.value
    S.assert_equal(first.grad.to_local().clone(), initial_grad * inv_scale)
    initial_scale, initial_state = scaler.get_scale(), copy.copy(opt.state)
    scaler.step(opt)
    stepped = copy.copy(opt.state)
    if has_inf:
        S.assert_equal(stepped, initial_state)
    else:
        assert stepped.items() != initial_state.items()
    scaler.update()
    expected = initial_scale * scaler.get_backoff_factor() if has_inf else initial_scale
    assert scaler.get_scale() == expected, (scaler.get_scale(), expected)


CASES = S.Cases2()
for _inf in (True, False):
    CASES.add(case_gradient_scaler, has_inf=_inf)
XFAIL: dict = {}
FAST = ("gradient_scaler:has_inf=True",)


@pytest.mark.parametrize("cid", S.H.params(CASES, XFAIL, FAST))
def test_case(cid):
    S.check(__name__, cid)
