"""Port of torch's test_fully_shard_state.py: the state object, re-applying, the class swap, containers, deepcopy.

torch's checks (one rank in torch's; 2 here, no collective involved): ``fully_shard.state(module)`` gives a distinct
state per call; re-applying ``fully_shard`` raises AssertionError ("can only be applied to a module once"); only the
module passed gets the ``FSDP<Orig>`` class, which is still an ``Orig``, and slicing a sharded ``Sequential`` gives a
plain ``Sequential``; ``ModuleList`` / ``ModuleDict`` are refused (ValueError); ``deepcopy`` raises AssertionError.
"""

import copy

import pytest
import torch.nn as nn
from torch.testing._internal.common_fsdp import MLP

from tests.torch_suite.fsdp2 import _side as S
from tests.torch_suite.fsdp2.test_init import _raises


def case_fully_shard_state(api):
    model = nn.Sequential(*[MLP(8) for _ in range(3)])
    for mlp in model:
        api.fully_shard(mlp)
    api.fully_shard(model)
    root = api.fully_shard.state(model)
    assert root is not None
    states = [root] + [api.fully_shard.state(mlp) for mlp in model]
    assert len({id(s) for s in states}) == 4


def case_fully_shard_reapply(api):
    model = MLP(8)
    api.fully_shard(model)
    _raises(lambda: api.fully_shard(model), AssertionError,
            "Each distinct composable distributed API can only be applied to a module once.")


def case_fully_shard_cls(api):
    model = MLP(8)
    api.fully_shard(model)
    assert isinstance(model, MLP) and isinstance(model, api.FSDPModule) and type(model).__name__ == "FSDPMLP"
    assert not any(isinstance(m, api.FSDPModule) for m in model.modules() if m is not model)
    model = nn.Sequential(*[MLP(8) for _ in range(3)])
    api.fully_shard(model)
    assert isinstance(model, nn.Sequential) and type(model).__name__ == "FSDPSequential"
    sliced = model[:2]
    assert isinstance(sliced, nn.Sequential) and not isinstance(sliced, api.FSDPModule), type(sliced)


def case_fully_shard_unsupported_module_cls(api):
    text = "fully_shard does not support containers that do not implement forward"
    _raises(lambda: api.fully_shard(nn.ModuleList([MLP(8) for _ in range(3)])), ValueError, text)
    _raises(lambda: api.fully_shard(nn.ModuleDict({"1": MLP(8), "2": MLP(8)})), ValueError, text)


def case_fully_shard_deepcopy(api):
    model = MLP(8)
    api.fully_shard(model)
    _raises(lambda: copy.deepcopy(model), AssertionError, "FSDP does not support deepcopy")


CASES = S.Cases2()
for _fn in (case_fully_shard_state, case_fully_shard_reapply, case_fully_shard_cls,
            case_fully_shard_unsupported_module_cls, case_fully_shard_deepcopy):
    CASES.add(_fn)
XFAIL: dict = {}
FAST = ("fully_shard_cls",)


@pytest.mark.parametrize("cid", S.H.params(CASES, XFAIL, FAST))
def test_case(cid):
    S.check(__name__, cid)
