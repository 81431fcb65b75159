"""Port of torch's test_fully_shard_ignore_params.py: ``ignored_params`` composed with DDP.

torch's check: model A(B(C)); ``fully_shard`` post-order on B and its submodules with C's parameters ignored (so
only B and B.lin_b become sharded modules), then DDP over the whole model ignoring what FSDP shards (but not what
FSDP ignored): same parameters and names as a plain DDP reference before training, and equal losses and full
parameters over 3 Adam steps (``assert_close``).
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.experimental import implicit_replication
from torch.nn.parallel import DistributedDataParallel as DDP

from tests.torch_suite.fsdp2 import _side as S


class C(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.lin_c = nn.Linear(dim, dim)

    def forward(self, x):
        return self.lin_c(x)


class B(nn.Module):
    def __init__(self, dim, subtrahend):
        super().__init__()
        self.lin_b, self.module_c, self.subtrahend = nn.Linear(dim, dim), C(dim), nn.Parameter(subtrahend)

    def forward(self, x):
        return self.lin_b(self.module_c(x)) - self.subtrahend


class A(nn.Module):
    def __init__(self, dim, addend, subtrahend):
        super().__init__()
        self.module_b, self.addend = B(dim, subtrahend), nn.Parameter(addend)

    def forward(self, x):
        return (self.module_b(x) + self.addend).sum()


def _model():
    dim = 8
    torch.manual_seed(42)
    addend = torch.randn(dim, dim)
    torch.manual_seed(70)
    sub = torch.randn(dim, dim)
    model = A(dim, addend, sub)
    torch.manual_seed(84)
    return model, torch.randn(dim, dim)


def _full(p):
    return p.full_tensor() if isinstance(p, DTensor) else p


def _wrap(api, module, mesh, path, ignored_path, ignored):
    if path != ignored_path:
        for name, child in list(module.named_children()):
            _wrap(api, child, mesh, f"{path}.{name}" if path else name, ignored_path, ignored)
        api.fully_shard(module, mesh=mesh, ignored_params=ignored)
    return module


def _sharded_modules(api, module, path=""):
    out = {path} if isinstance(module, api.FSDPModule) else set()
    for name, child in module.named_children():
        out |= _sharded_modules(api, child, f"{path}.{name}" if path else name)
    return out


def case_ddp_A_fsdp_B_ddp_C(api):
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    ref, ref_inp = _model()
    ref = DDP(ref)
    ref_optim = torch.optim.Adam(ref.parameters(), lr=1e-2)
    ref_params = dict(ref.named_parameters())
    test, inp = _model()
    ignored = set(test.module_b.module_c.parameters())
    test.module_b = _wrap(api, test.module_b, mesh, "module_b", "module_b.module_c", ignored)
    assert _sharded_modules(api, test) == {"module_b", "module_b.lin_b"}, _sharded_modules(api, test)
    names = dict(test.named_parameters())
    ddp_ignored = [n for n in ("module_b.subtrahend", "module_b.lin_b.weight", "module_b.lin_b.bias")
                   if names[n] not in ignored]
    DDP._set_params_and_buffers_to_ignore_for_model(module=test, params_and_buffers_to_ignore=ddp_ignored)
    test = DDP(test, broadcast_buffers=False)
    optim = torch.optim.Adam(test.parameters(), lr=1e-2)
    params = dict(test.named_parameters())

    def compare():
        assert set(params) == set(ref_params), (set(params), set(ref_params))
        for name, p in ref_params.items():
            torch.testing.assert_close(_full(p), _full(params[name]))

    compare()
    for _ in range(3):
        ref_loss, loss = ref(ref_inp), test(inp)
        torch.testing.assert_close(ref_loss, loss)
        ref_loss.backward()
        loss.backward()
        with implicit_replication():
            ref_optim.step()
            ref_optim.zero_grad()
            optim.step()
            optim.zero_grad()
            compare()


CASES = S.Cases2()
CASES.add(case_ddp_A_fsdp_B_ddp_C)
XFAIL: dict = {}
FAST: tuple = ()


@pytest.mark.parametrize("cid", S.H.params(CASES, XFAIL, FAST))
def test_case(cid):
    S.check(__name__, cid)
