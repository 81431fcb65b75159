"""Port of torch's test_fully_shard_state_dict.py: ``state_dict()`` / ``load_state_dict()`` of sharded modules.

torch's checks:
- save / load round trip (@4: a 1-D mesh and HSDP's 2x2; MLP widths 2-5, and 16 sharded on the largest dim): every
  parameter a DTensor; ``state_dict()`` values are DTensors sharing storage with the parameters (or, for a rank
  past the last chunk, empty padding); loading DTensors with other storages writes the values in place (the
  storage kept where the sharding is even); with ``reshard_after_forward=False`` the state dict after a forward
  (full parameters on the modules) equals the one before;
- the state dict made once keeps sharing storage with the parameters across 5 optimizer steps (moving the model
  to CUDA and back is the other half of torch's case: not on a CPU machine);
- CPU offload: a model built on the meta device, loaded piece by piece with ``assign=True, strict=False``, then
  a forward; the state dict stays on the CPU;
- a full CPU state dict gathered on rank 0 only equals the unsharded model's.
(The tensor-parallel 2-D and 3-D variants are left out.)
"""

import copy
import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.testing._internal.common_fsdp import MLP
from torch.testing._internal.distributed._tensor.common_dtensor import ModelArgs, Transformer, TransformerBlock

from tests.torch_suite.fsdp2 import _side as S


def _save_load(model):
    for name, p in model.named_parameters():
        assert isinstance(p, DTensor), f"{name} is a {type(p).__name__}, not a DTensor"
    old, new = 1, 42 + dist.get_rank()
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(old)
    ptrs = {n: p.to_local().data_ptr() for n, p in model.named_parameters()}
    sizes = [p.size() for p in model.parameters()]
    sd = model.state_dict()
    for p, size in zip(model.parameters(), sizes):
        assert p.size() == size and isinstance(p, nn.Parameter)
    assert set(sd) == set(ptrs), (set(sd), set(ptrs))
    for name, t in sd.items():
        assert isinstance(t, DTensor)
        if ptrs[name] == 0:
            assert dist.get_rank() > 0 and torch.count_nonzero(t.to_local()).item() == 0
        else:
            assert t.to_local().data_ptr() == ptrs[name], f"{name}: the state dict does not share the storage"
    new_sd = {n: t.detach().clone().fill_(new) for n, t in sd.items()}
    for p in model.parameters():
        S.assert_equal(p.to_local(), torch.ones_like(p.to_local()) * old)
    model.load_state_dict(new_sd)
    for name, p in model.named_parameters():
        S.assert_equal(p.to_local(), torch.ones_like(p.to_local()) * new)
        if p.to_local().size(0) * p.device_mesh.size() == p.size(0):
            assert p.to_local().data_ptr() == ptrs[name], f"{name}: loading moved an evenly sharded parameter"


def _largest(p):
    best = max(range(p.ndim), key=lambda d: (p.shape[d], -d))
    return Shard(best)


def case_dp_state_dict_save_load(api, mlp_dim, hsdp, placement_fn):
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp_replicate", "dp_shard")) if hsdp \
        else init_device_mesh("cpu", (world,))
    torch.manual_seed(42)
    base = nn.Sequential(MLP(mlp_dim), nn.Sequential(MLP(mlp_dim), nn.Linear(mlp_dim, mlp_dim)), MLP(mlp_dim))
    shard = functools.partial(api.fully_shard, mesh=mesh, shard_placement_fn=_largest if placement_fn else None)
    model1 = copy.deepcopy(base)
    for m in model1:
        shard(m)
    shard(model1)
    _save_load(model1)
    model2 = copy.deepcopy(base)
    for m in model2:
        shard(m, reshard_after_forward=False)
    shard(model2, reshard_after_forward=False)
    _save_load(model2)
    ref_sd = model2.state_dict()
    model2(torch.randn(2, mlp_dim))
    sd = model2.state_dict()
    assert set(ref_sd) == set(sd)
    for k, v in ref_sd.items():
        S.assert_equal(v, sd[k])


def case_cached_state_dict(api, mlp_dim):
    torch.manual_seed(42)
    model = nn.Linear(mlp_dim, mlp_dim, bias=False)
    api.fully_shard(model, reshard_after_forward=True)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sd = model.state_dict()
    assert isinstance(model.weight, DTensor)
    same = sd["weight"].to_local().untyped_storage().data_ptr() == model.weight.to_local().untyped_storage().data_ptr()
    assert same, "the state dict does not share the parameter's storage"
    torch.manual_seed(42 + dist.get_rank())
    inp = torch.rand(mlp_dim, mlp_dim)
    for _ in range(5):
        optim.zero_grad()
        model(inp).sum().backward()
        optim.step()
        assert sd["weight"].to_local().untyped_storage().data_ptr() == \
            model.weight.to_local().untyped_storage().data_ptr()


def case_dp_state_dict_cpu_offload(api, pin_memory, cpu_state_dict):
    dim = 4
    policy = CPUOffloadPolicy(pin_memory=pin_memory)
    torch.manual_seed(42)
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(dim, dim, bias=False), nn.Linear(dim, dim, bias=False))
    for m in model:
        api.fully_shard(m, offload_policy=policy)
    api.fully_shard(model, offload_policy=policy)
    pieces = []
    for name, dt in model.named_parameters():
        sharded = distribute_tensor(torch.randn(dt.size()), dt.device_mesh, dt.placements)
        pieces.append({name: sharded.cpu() if cpu_state_dict else sharded})
    for sd in pieces:
        model.load_state_dict(sd, assign=True, strict=False)
    model(torch.rand(dim, dim)).sum()
    for name, t in model.state_dict().items():
        assert t.device.type == "cpu", name


def case_rank0_offload_full_state_dict(api):
    torch.manual_seed(42)
    ref = Transformer(ModelArgs(dropout_p=0.0))
    S.broadcast_params(ref)
    model = copy.deepcopy(ref)
    for m in model.modules():
        if isinstance(m, TransformerBlock):
            api.fully_shard(m)
    api.fully_shard(model)
    sharded = model.state_dict()
    ref_full = {k: v.cpu() for k, v in ref.state_dict().items()} if dist.get_rank() == 0 else None
    full = {}
    for name, t in sharded.items():
        whole = t.full_tensor()
        if dist.get_rank() == 0:
            full[name] = whole.cpu()
    if dist.get_rank() == 0:
        assert list(full) == list(ref_full)
        for a, b in zip(full.values(), ref_full.values()):
            assert a.device == b.device == torch.device("cpu")
            S.assert_equal(a, b)
    else:
        assert not full


CASES = S.Cases2()
for _hsdp in (False, True):
    for _d in (2, 3, 4, 5):
        CASES.add(case_dp_state_dict_save_load, world=4, mlp_dim=_d, hsdp=_hsdp, placement_fn=False)
    CASES.add(case_dp_state_dict_save_load, world=4, mlp_dim=16, hsdp=_hsdp, placement_fn=True)
for _d in (2, 3, 4, 5):
    CASES.add(case_cached_state_dict, mlp_dim=_d)
for _pin in (True, False):
    for _cpu in (True, False):
        CASES.add(case_dp_state_dict_cpu_offload, pin_memory=_pin, cpu_state_dict=_cpu)
CASES.add(case_rank0_offload_full_state_dict)
XFAIL: dict = {}
FAST = ("cached_state_dict:mlp_dim=3",)


@pytest.mark.parametrize("cid", S.H.params(CASES, XFAIL, FAST))
def test_case(cid):
    S.check(__name__, cid)
