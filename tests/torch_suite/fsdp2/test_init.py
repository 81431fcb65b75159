"""Port of torch's test_fully_shard_init.py: what ``fully_shard`` does at construction and at lazy init.

torch's checks, by behaviour (torch's own file also calls its private helpers ``_get_managed_modules`` /
``_get_param_module_infos``; here the same facts are read from which parameters end up sharded):
- the mesh argument: a 3-D mesh (ValueError), a 2-D mesh without dim names (AssertionError);
- managed parameters: nested ``fully_shard`` calls keep theirs, a module used twice and parameters tied inside
  one call are sharded once, a list of modules takes all their parameters;
- each sharded parameter is a DTensor on the world mesh with the original size and stride, ``(Shard(0),)``, and
  local rows ``torch.chunk``'s (uneven widths; a tied in-projection once);
- a scalar parameter (ValueError) and a non-contiguous one (NotImplementedError) are refused;
- lazy init: a forward through a non-root first, then the root, is refused; a list of modules cannot be the root;
- meta device: ``fully_shard`` before ``to_empty`` (widths 8, 3 and 1: even, uneven, empty local rows; fp32 and
  bf16 mixed precision; also inside ``with torch.device("meta")``), then ``reset_parameters()`` gives new values and
  an iteration runs; a forward before ``to_empty`` names the parameters still on meta; a parameter replaced after
  ``to_empty`` (torch's ``reset_sharded_param`` case) trains;
- a meta-device Transformer loaded from rank 0's full state dict (broadcast, ``distribute_tensor``,
  ``load_state_dict(assign=True)``) equals one sharded from the full model, forward and gradients included;
- a 1-D mesh made from a process group (``DeviceMesh.from_group``) trains as the mesh it came from (@4);
- HSDP replicas made equal by broadcasting from the replicate group's first rank train (@4).
"""

import copy
import itertools

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.testing._internal.common_fsdp import MLP
from torch.testing._internal.distributed._tensor.common_dtensor import ModelArgs, Transformer, TransformerBlock

from tests.torch_suite.fsdp2 import _side as S


def _raises(fn, kind, text):
    try:
        fn()
    except kind as e:
        assert text in str(e), f"{type(e).__name__} without {text!r}: {e}"
        return
    raise AssertionError(f"no {kind.__name__} ({text})")


def case_invalid_mesh_ndim(api):
    mesh = init_device_mesh("cpu", (dist.get_world_size(), 1, 1))
    _raises(lambda: api.fully_shard(MLP(8), mesh=mesh), ValueError, "fully_shard expects a 1D or 2D DeviceMesh")


def case_2d_mesh_without_mesh_dim_names(api):
    mesh = init_device_mesh("cpu", (dist.get_world_size() // 2, 2))
    _raises(lambda: api.fully_shard(MLP(8), mesh=mesh), AssertionError,
            "Please init the 2D mesh for HSDP with mesh_dim_names specified")


def _sharded(model) -> set:
    return {n for n, p in model.named_parameters() if isinstance(p, DTensor)}


def case_managed_params(api, layout):
    if layout == "nested":
        model = nn.Sequential(*[MLP(8) for _ in range(2)])
        api.fully_shard(model[0])
        api.fully_shard(model)
        assert _sharded(model) == {n for n, _ in model.named_parameters()}
        assert api.fully_shard.state(model[0]) is not api.fully_shard.state(model)
    elif layout == "duplicate":
        mlp = MLP(8)
        model = nn.Sequential(mlp, mlp)
        api.fully_shard(model)
        assert len(list(model.parameters())) == 4 and _sharded(model) == {n for n, _ in model.named_parameters()}
    elif layout == "shared_params":
        model = nn.Sequential(*[MLP(8, with_buffer=True) for _ in range(3)])
        model[0].in_proj.weight = model[1].in_proj.weight
        model[2].in_proj.weight = model[1].in_proj.weight
        model[1].buffer = model[2].buffer
        n_params, n_buffers = len(list(model.parameters())), len(list(model.buffers()))
        api.fully_shard(model)
        assert len(list(model.parameters())) == n_params and len(list(model.buffers())) == n_buffers
        assert model[0].in_proj.weight is model[1].in_proj.weight is model[2].in_proj.weight
        assert isinstance(model[0].in_proj.weight, DTensor)
    else:  # a list of modules: one group with all their parameters, the rest untouched
        model = nn.Sequential(*[MLP(8) for _ in range(5)])
        api.fully_shard([model[0], model[1], model[2]])
        assert _sharded(model) == {n for n, _ in model.named_parameters() if n[0] in "012"}
        assert api.fully_shard.state(model[0]) is api.fully_shard.state(model[2])


def _check_1d_sharded(orig, sharded):
    assert len(orig) == len(sharded)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for o, p in zip(orig, sharded):
        assert isinstance(p, DTensor)
        assert p.device_mesh == mesh, (p.device_mesh, mesh)
        assert p.size() == o.size() and p.stride() == o.stride()
        assert tuple(p.placements) == (Shard(0),)
        S.assert_equal(p.to_local(), torch.chunk(o, dist.get_world_size(), dim=0)[dist.get_rank()])


def case_shard_tensor_parameters(api):
    model = nn.Sequential(*[MLP(3, dim_multiplier=3) for _ in range(3)])
    orig = [p.detach().clone() for p in model.parameters()]
    api.fully_shard(model)
    _check_1d_sharded(orig, list(model.parameters()))
    model = nn.Sequential(*[MLP(3, dim_multiplier=3) for _ in range(3)])
    model[0].in_proj = model[1].in_proj
    orig = [p.detach().clone() for p in model.parameters()]
    api.fully_shard(model)
    _check_1d_sharded(orig, list(model.parameters()))


def case_raise_scalar_parameter(api):
    model = nn.Sequential(*[MLP(3, dim_multiplier=3) for _ in range(3)])
    model.register_parameter("scalar_p", nn.Parameter(torch.tensor(1.0)))
    _raises(lambda: api.fully_shard(model), ValueError, "Change scalar_p to a 1D tensor with numel equal to 1.")


def case_raise_noncontiguous_parameter(api):
    conv = nn.Conv2d(8, 8, 3).to(memory_format=torch.channels_last)
    _raises(lambda: api.fully_shard(conv), NotImplementedError, "FSDP does not support non-contiguous parameters")


def case_double_lazy_init(api):
    model = nn.Sequential(MLP(8), MLP(8))
    api.fully_shard(model[0].in_proj)
    api.fully_shard(model[0].out_proj)
    api.fully_shard(model)
    model[0].in_proj(torch.randn(2, 8))
    _raises(lambda: model(torch.randn(2, 8)), RuntimeError,
            "FSDP state has already been lazily initialized for 0.in_proj\nFSDP requires running forward through "
            "the root module first")


def case_multi_module_root(api):
    model = nn.Sequential(MLP(8), MLP(8))
    api.fully_shard([model[0], model[1]])
    _raises(lambda: model[0](torch.randn(2, 8)), RuntimeError, "FSDP requires a single root module but got ")


def case_reset_sharded_param_in_lazy_init(api):
    class MyModel(nn.Module):
        def __init__(self):
            super().__init__()
            self.layer1, self.layer2 = nn.Linear(3, 3, bias=False), nn.Linear(3, 3, bias=False)
            self.weight_norm = nn.Parameter(torch.empty(3))

        def forward(self, inp):
            return self.layer2(self.layer1(inp)).sum() + self.weight_norm.sum()

    with torch.device("meta"):
        model = MyModel()
    for m in (model.layer1, model.layer2, model):
        api.fully_shard(m)
    model.layer1.to_empty(device="cpu")
    model.layer2.to_empty(device="cpu")
    with torch.no_grad():
        norm = torch.linalg.norm(model.layer1.weight, dim=1) + torch.linalg.norm(model.layer2.weight, dim=1)
    model.weight_norm = nn.Parameter(norm)
    model(torch.randn(3, 3)).sum().backward()


def _to_empty_and_reset(model, dim):
    model.to_empty(device="cpu")
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    const = 1337
    for t in itertools.chain(model.parameters(), model.buffers()):
        t.detach().fill_(const)
    for m in model.modules():
        if hasattr(m, "reset_parameters"):
            m.reset_parameters()
    for p in model.parameters():
        local = p.to_local()
        if local.numel() > 0:
            assert not torch.equal(local, torch.ones_like(local) * const), "reset_parameters() changed nothing"
    for b in model.buffers():
        assert not torch.equal(b, torch.ones_like(b) * const)
    model(torch.randn(4, dim)).sum().backward()
    optim.step()


def case_meta_device_1d_init(api):
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for dim in (8, 3, 1):
        for mp in (MixedPrecisionPolicy(), MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                                reduce_dtype=torch.float32)):
            with torch.device("meta"):
                model = nn.Sequential(MLP(dim, dim_multiplier=1, with_buffer=True, bias=False),
                                      MLP(dim, dim_multiplier=1, bias=False))
                for m in (model[0], model[1], model):
                    api.fully_shard(m, mesh=mesh, mp_policy=mp)
            assert all(p.device.type == "meta" for p in model.parameters())
            _to_empty_and_reset(model, dim)
    with torch.device("meta"):
        model = nn.Sequential(MLP(8, with_buffer=True), MLP(8))
        for m in (model[0], model[1], model):
            api.fully_shard(m)
    assert all(p.device.type == "meta" for p in model.parameters())
    _to_empty_and_reset(model, 8)


def case_invalid_meta_device_init(api):
    with torch.device("meta"):
        model = nn.Sequential(MLP(8, with_buffer=True), MLP(8))
        for m in (model[0], model[1], model):
            api.fully_shard(m)
    _raises(lambda: model(torch.randn(4, 8)), RuntimeError,
            "FSDP parameters should be materialized from meta device before training, but the following were still "
            "on meta device: ['0.in_proj.weight', '0.in_proj.bias', '0.out_proj.weight', '0.out_proj.bias']")


def case_rank0_broadcast_meta_device_init(api):
    args = ModelArgs(dropout_p=0.0)
    rank = dist.get_rank()
    if rank == 0:
        torch.manual_seed(42)
        ref = Transformer(args)
        full_sd = ref.state_dict()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    with torch.device("meta"):
        model = Transformer(args)
    for m in model.modules():
        if isinstance(m, TransformerBlock):
            api.fully_shard(m, mesh=mesh)
    api.fully_shard(model, mesh=mesh)
    meta_sd = model.state_dict()
    sharded = {}
    for i, (name, meta) in enumerate(meta_sd.items()):
        full = list(full_sd.values())[i].detach().clone() if rank == 0 else \
            torch.empty(meta.size(), dtype=meta.dtype)
        dist.broadcast(full, src=0, group=meta.device_mesh.get_group(0))
        sharded[name] = nn.Parameter(distribute_tensor(full, meta.device_mesh, meta.placements))
    model.load_state_dict(sharded, assign=True)
    for p in model.parameters():
        assert isinstance(p, DTensor) and p.device.type == "cpu"
    if rank != 0:
        ref = Transformer(args)
    S.broadcast_params(ref)
    for m in ref.modules():
        if isinstance(m, TransformerBlock):
            api.fully_shard(m, mesh=mesh)
    api.fully_shard(ref, mesh=mesh)
    for (n, p), (rn, rp) in zip(model.named_parameters(), ref.named_parameters()):
        assert n == rn
        S.assert_equal(p, rp)
    inp = torch.randint(0, args.vocab_size, (2, 16))
    loss = model(inp).sum()
    loss.backward()
    ref_loss = ref(inp).sum()
    ref_loss.backward()
    S.assert_equal(loss, ref_loss)
    for p, rp in zip(model.parameters(), ref.parameters()):
        S.assert_equal(p.grad, rp.grad)


def case_1d_process_group_init(api):
    world = init_device_mesh("cpu", (2, dist.get_world_size() // 2), mesh_dim_names=("dp", "tp"))
    ref_dp, tp = world["dp"], world["tp"]
    dp = DeviceMesh.from_group(ref_dp.get_group(0), "cpu", mesh_dim_names=("dp",))
    S.assert_equal(dp.mesh, ref_dp.mesh)
    torch.manual_seed(42)
    ref = MLP(8)
    S.broadcast_params(ref)
    model = copy.deepcopy(ref)
    for m in (ref.in_proj, ref.out_proj, ref):
        api.fully_shard(m, mesh=ref_dp)
    for m in (model.in_proj, model.out_proj, model):
        api.fully_shard(m, mesh=dp)
    inp = torch.randn(4, 8)
    dist.broadcast(inp, src=dist.get_process_group_ranks(tp.get_group(0))[0], group=tp.get_group(0))
    ref_loss = ref(inp).sum()
    ref_loss.backward()
    loss = model(inp).sum()
    loss.backward()
    S.assert_equal(loss, ref_loss)
    for p, rp in zip(model.parameters(), ref.parameters()):
        S.assert_equal(p.to_local(), rp.to_local())
        S.assert_equal(p.grad.to_local(), rp.grad.to_local())


def case_hsdp_broadcast_across_replicas(api):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    args = ModelArgs()
    model = Transformer(args)
    model.buf = torch.nn.Buffer(torch.randn(args.dim))
    for m in model.modules():
        if isinstance(m, TransformerBlock):
            api.fully_shard(m, mesh=mesh)
    api.fully_shard(model, mesh=mesh)
    if mesh.get_local_rank("replicate") > 0:
        for t in itertools.chain(model.parameters(), model.buffers()):
            t.detach().fill_(1337)
    group = mesh.get_group("replicate")

    def gathered(t):
        local = t.to_local() if isinstance(t, DTensor) else t
        out = [torch.empty_like(local) for _ in range(mesh["replicate"].size())]
        dist.all_gather(out, local, group=group)
        return out

    for t in itertools.chain(model.parameters(), model.buffers()):
        first, *rest = gathered(t)
        assert all(not torch.equal(x, first) for x in rest) or first.numel() == 0
    for t in itertools.chain(model.parameters(), model.buffers()):
        dist.broadcast(t.to_local() if isinstance(t, DTensor) else t, src=dist.get_process_group_ranks(group)[0],
                       group=group)
    for t in itertools.chain(model.parameters(), model.buffers()):
        first, *rest = gathered(t)
        assert all(torch.equal(x, first) for x in rest)
    model(torch.randint(0, args.vocab_size, (2, 16))).sum().backward()


CASES = S.Cases2()
for _fn in (case_invalid_mesh_ndim, case_2d_mesh_without_mesh_dim_names):
    CASES.add(_fn, world=4)
for _layout in ("nested", "duplicate", "shared_params", "list_of_mlps"):
    CASES.add(case_managed_params, layout=_layout)
for _fn in (case_shard_tensor_parameters, case_raise_scalar_parameter, case_raise_noncontiguous_parameter,
            case_double_lazy_init, case_multi_module_root, case_reset_sharded_param_in_lazy_init):
    CASES.add(_fn)
for _fn in (case_meta_device_1d_init, case_invalid_meta_device_init, case_rank0_broadcast_meta_device_init):
    CASES.add(_fn)
for _fn in (case_1d_process_group_init, case_hsdp_broadcast_across_replicas):
    CASES.add(_fn, world=4)
XFAIL: dict = {}
FAST = ("meta_device_1d_init",)


@pytest.mark.parametrize("cid", S.H.params(CASES, XFAIL, FAST))
def test_case(cid):
    S.check(__name__, cid)
