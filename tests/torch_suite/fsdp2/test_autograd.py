"""Port of torch's test_fully_shard_autograd.py: gradients through unused outputs, unused modules, containers.

torch's checks (a reference that sees the global batch; each rank its slice), 10 iterations each:
- an output of a sharded module left out of the loss (``DoubleLinear`` returning two outputs, the second unused
  after 3 iterations), ``reshard_after_forward`` in {True, False, 2};
- a sharded module that never runs forward (``lin2`` of ``DoubleLinear(use_second_linear=False)``), same values;
- activations carried between sharded modules in a list, a namedtuple, a tuple or a dict (and, as torch's
  mixed-precision file does for its structured inputs, a dataclass).
Every iteration: the all-reduced loss equals the reference's, and ``check_sharded_parity``.
"""

import collections
import copy
import dataclasses

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.testing._internal.common_fsdp import DoubleLinear

from tests.torch_suite.fsdp2 import _side as S


def _reduce_partial(model):
    for p in model.parameters():
        if p.grad is not None:
            p.grad.div_(dist.get_world_size())


def _local(global_inp, local_bs=2):
    r = dist.get_rank()
    return global_inp[r * local_bs: (r + 1) * local_bs].detach()


def case_unused_forward_output(api, raf):
    torch.manual_seed(42)
    dim = 24
    model = DoubleLinear(dim=dim, use_second_linear=True)
    ref = copy.deepcopy(model)
    api.fully_shard(model.lin1, reshard_after_forward=raf)
    api.fully_shard(model, reshard_after_forward=raf)
    ref_optim, optim = (torch.optim.Adam(m.parameters(), lr=1e-2) for m in (ref, model))
    torch.manual_seed(1)
    for it in range(10):
        g = torch.rand(dist.get_world_size() * 2, dim)
        out1, out2 = model(_local(g))
        loss = (out1 * out2).sum() if it < 3 else out1.sum()
        loss.backward()
        optim.step()
        r1, r2 = ref(g)
        ref_loss = (r1 * r2).sum() if it < 3 else r1.sum()
        ref_loss.backward()
        _reduce_partial(ref)
        ref_optim.step()
        dist.all_reduce(loss)
        S.assert_equal(loss, ref_loss)
        optim.zero_grad(set_to_none=bool(it % 2))
        ref_optim.zero_grad(set_to_none=bool(it % 2))
        S.sharded_parity(ref, model)


def case_unused_forward_module(api, raf):
    torch.manual_seed(42)
    dim = 24
    model = DoubleLinear(dim=dim, use_second_linear=False)
    ref = copy.deepcopy(model)
    for m in (model.lin1, model.lin2, model):
        api.fully_shard(m, reshard_after_forward=raf)
    ref_optim, optim = (torch.optim.Adam(m.parameters(), lr=1e-2) for m in (ref, model))
    torch.manual_seed(1)
    for it in range(10):
        g = torch.rand(dist.get_world_size() * 2, dim)
        losses = []
        for m, inp in ((ref, g), (model, _local(g))):
            losses.append(m(inp).sum())
            losses[-1].backward()
        _reduce_partial(ref)
        dist.all_reduce(losses[1])
        S.assert_equal(losses[0], losses[1])
        S.sharded_parity(ref, model)
        for o in (optim, ref_optim):
            o.step()
            o.zero_grad(set_to_none=bool(it % 2))


NT = collections.namedtuple("NT", "x y")


@dataclasses.dataclass
class DC:
    x: torch.Tensor


class _Module(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.lin1, self.lin2, self.relu = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.ReLU()

    def _f(self, x):
        return self.relu(self.lin2(self.relu(self.lin1(x))))

    def forward(self, inp):
        if isinstance(inp, list):
            return [self._f(inp[0])]
        if isinstance(inp, NT):
            return NT(self._f(inp[0]), inp[1])
        if isinstance(inp, tuple):
            return (self._f(inp[0]),)
        if isinstance(inp, dict):
            return {"x": self._f(inp["x"])}
        return DC(self._f(inp.x))


class _To(nn.Module):
    def __init__(self, kind):
        super().__init__()
        self.kind = kind

    def forward(self, x):
        return {"list": lambda: [x], "namedtuple": lambda: NT(x, torch.ones_like(x)), "tuple": lambda: (x,),
                "dict": lambda: {"x": x}, "dataclass": lambda: DC(x)}[self.kind]()


class _From(nn.Module):
    def __init__(self, kind):
        super().__init__()
        self.kind = kind

    def forward(self, x):
        return x["x"] if self.kind == "dict" else x.x if self.kind == "dataclass" else x[0]


def case_nontensor_activations(api, container):
    torch.manual_seed(42)
    dim = 24
    model = nn.Sequential(_To(container), _Module(dim), _Module(dim), _Module(dim), _From(container))
    ref = copy.deepcopy(model)
    for m in model:
        api.fully_shard(m)
    api.fully_shard(model)
    ref_optim, optim = (torch.optim.Adam(m.parameters(), lr=1e-2) for m in (ref, model))
    torch.manual_seed(1)
    for it in range(10):
        g = torch.rand(dist.get_world_size() * 2, dim)
        losses = []
        for m, inp in ((ref, g), (model, _local(g))):
            losses.append(m(inp).sum())
            losses[-1].backward()
        _reduce_partial(ref)
        dist.all_reduce(losses[1])
        S.assert_equal(losses[0], losses[1])
        S.sharded_parity(ref, model)
        for o in (optim, ref_optim):
            o.step()
            o.zero_grad(set_to_none=bool(it % 2))


CASES = S.Cases2()
for _raf in (True, False, 2):
    CASES.add(case_unused_forward_output, raf=_raf)
    CASES.add(case_unused_forward_module, raf=_raf)
for _c in ("list", "namedtuple", "tuple", "dict", "dataclass"):
    CASES.add(case_nontensor_activations, container=_c)
XFAIL: dict = {}
FAST = ("nontensor_activations:container=dataclass",)


@pytest.mark.parametrize("cid", S.H.params(CASES, XFAIL, FAST))
def test_case(cid):
    S.check(__name__, cid)
