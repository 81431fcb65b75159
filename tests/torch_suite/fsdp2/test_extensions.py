"""Port of torch's test_fully_shard_extensions.py: all-gather extensions (``fsdp_pre_all_gather`` /
``fsdp_post_all_gather`` on the parameters' local tensors).

torch's checks, on CPU/gloo at 2 ranks (4 for the HSDP mesh; torch runs some of these in 8 threads):

* train parity: a ``Sequential`` of three bias-free MLPs whose weights are ``TwoTensor`` (a subclass holding two
  tensors); the pre hook sends both inner tensors (two all-gather inputs per weight), the post hook builds a
  ``TwoTensor`` of the two outputs, and on later gathers (``out=``) checks that the outputs are the storages of the
  unsharded parameter it made first.  Against a replicated reference (gradients all-reduced by hand), 10 Adam
  steps: losses equal and ``check_sharded_parity`` before and after each step.  Both hook signatures (the older
  ``(mesh)`` one and the five-argument one), ``reshard_after_forward`` True and False.
* end to end: the same model made on the meta device, sharded with ``MixedPrecisionPolicy(param_dtype=bf16)``,
  ``to_empty`` and initialized, 3 steps without error (the post hook casts to bf16, so ``out=`` copies).
* monkey patch: hooks patched onto the local tensor objects after ``to_empty``; the pre hook sends bf16, the post
  hook casts back to fp32 (the gathered dtype is not the parameter's); 3 steps; the pre hook ran.
* outer size and stride: an MLP of width 3 whose weights are a subclass that pads itself in the pre hook to the
  padded sharded size (uneven shards), gathered in bf16 beside the fp32 biases in one group (torch gathers such a
  group as bytes); one step of fused AdamW.
* HSDP mesh: on a 2x2 mesh the pre hook receives the 1-D shard mesh.

Beyond torch's checks: each case but the last returns its losses and local shards, and ours must equal torch's
bitwise (``vs_torch=(0, 0)``).
"""

import contextlib
import copy
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.utils._pytree as pytree
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.testing._internal.common_fsdp import MLP
from torch.testing._internal.two_tensor import TwoTensor

from tests.torch_suite.fsdp2 import _side as S


# ---------------------------------------------------------------- the hooks, as torch's test defines them
def two_tensor_pre_v1(self, mesh):
    return (self.a, self.b), None


def two_tensor_pre_v2(self, mesh, outer_size, outer_stride, module, mp_policy):
    return (self.a, self.b), None


def two_tensor_post(self, outputs, metadata, param_dtype, *, out=None):
    assert metadata is None, metadata
    a, b = outputs
    if out is not None:
        assert isinstance(out, TwoTensor), type(out)
        if a.dtype == param_dtype:  # no cast: the unsharded parameter's inner tensors are the outputs
            assert a.untyped_storage().data_ptr() == out.a.untyped_storage().data_ptr()
            assert b.untyped_storage().data_ptr() == out.b.untyped_storage().data_ptr()
        else:
            assert out.a.dtype == param_dtype and out.b.dtype == param_dtype, (out.a.dtype, param_dtype)
            out.a.copy_(a)
            out.b.copy_(b)
        return None
    return TwoTensor(a, b).to(param_dtype), (a, b)


@contextlib.contextmanager
def two_tensor_hooks(version: int):
    TwoTensor.fsdp_pre_all_gather = two_tensor_pre_v1 if version == 1 else two_tensor_pre_v2
    TwoTensor.fsdp_post_all_gather = two_tensor_post
    dist.barrier()
    try:
        yield
    finally:
        dist.barrier()
        del TwoTensor.fsdp_pre_all_gather, TwoTensor.fsdp_post_all_gather


def two_tensor_mlps() -> nn.Module:
    model = nn.Sequential(*[MLP(8, bias=False) for _ in range(3)])
    for mlp in model:
        for lin in (mlp.in_proj, mlp.out_proj):
            lin.weight = nn.Parameter(TwoTensor(lin.weight, lin.weight.clone()))
    return model


class BF16GatherTensor(torch.Tensor):
    """torch's ``BFloat16AllGatherTensor``: a wrapper that gathers its data in bf16, padded by its own pre hook."""

    @staticmethod
    def __new__(cls, data):
        return torch.Tensor._make_wrapper_subclass(cls, data.shape, data.stride(), data.storage_offset(),
                                                   dtype=data.dtype, device=data.device)

    def __init__(self, data):
        self._data = data

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        assert mesh.ndim == 1, mesh.ndim
        rows = math.ceil(outer_size[0] / mesh.size())
        if outer_size[0] % mesh.size() != 0:
            padded = torch.empty((rows, *outer_size[1:]), dtype=torch.bfloat16, device=self.device)
            padded[: self._data.size(0)].copy_(self._data)
            return (padded,), None
        return (self._data.to(torch.bfloat16),), None

    def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None):
        assert metadata is None, metadata
        (tensor,) = outputs
        assert tensor.dtype == torch.bfloat16, tensor.dtype
        if out is not None:
            with torch.autograd._unsafe_preserve_version_counter(out):
                out.copy_(tensor)
            return None
        up = tensor.to(param_dtype)
        return up, (tensor, up)

    @classmethod
    def __torch_dispatch__(cls, func, types, args, kwargs=None):
        out = func(*pytree.tree_map_only(cls, lambda x: x._data, args),
                   **pytree.tree_map_only(cls, lambda x: x._data, kwargs or {}))
        return pytree.tree_map_only(torch.Tensor, cls, out)

    def __tensor_flatten__(self):
        return ["_data"], None

    @staticmethod
    def __tensor_unflatten__(inner, outer_size, outer_stride):
        return inner["_data"]


def _plain(t: torch.Tensor) -> torch.Tensor:
    """A result to compare across sides: a ``TwoTensor``'s two tensors stacked, a subclass's data, a DTensor's rows."""
    t = t.detach()
    t = t.to_local() if hasattr(t, "to_local") else t
    if isinstance(t, TwoTensor):
        return torch.stack([t.a, t.b]).clone()
    return (t._data if isinstance(t, BF16GatherTensor) else t).clone()


def _steps(model, optim, iters: int, width: int = 8) -> list:
    torch.manual_seed(42 + dist.get_rank() + 1)
    inp = torch.randn(2, width)
    losses = []
    for _ in range(iters):
        loss = model(inp).sum()
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(_plain(loss))
    return losses


# ---------------------------------------------------------------- cases
def case_train_parity(api, version, raf):
    with two_tensor_hooks(version):
        torch.manual_seed(42)
        model = two_tensor_mlps()
        ref = copy.deepcopy(model)
        ref_optim = torch.optim.Adam(ref.parameters(), lr=1e-2, foreach=True)
        for mlp in model:
            api.fully_shard(mlp, reshard_after_forward=raf)
        api.fully_shard(model, reshard_after_forward=raf)
        optim = torch.optim.Adam(model.parameters(), lr=1e-2, foreach=True)
        S.sharded_parity(ref, model)
        torch.manual_seed(42 + dist.get_rank() + 1)
        inp = torch.randn(2, 8)
        losses = []
        for it in range(10):
            pair = []
            for m in (ref, model):
                pair.append(m(inp).sum())
                pair[-1].backward()
                if m is ref:
                    for p in m.parameters():
                        dist.all_reduce(p.grad)
                        p.grad.detach().div_(dist.get_world_size())
            S.assert_equal(pair[0], pair[1], msg=f"iteration {it}: loss vs the replicated reference")
            S.sharded_parity(ref, model)
            for o in (ref_optim, optim):
                o.step()
                o.zero_grad(set_to_none=(it % 2 == 0))
            S.sharded_parity(ref, model)
            losses.append(_plain(pair[1]))
        return losses, [_plain(p) for p in model.parameters()]


def case_end_to_end(api, version, raf):
    with two_tensor_hooks(version):
        with torch.device("meta"):
            model = two_tensor_mlps()
        assert all(p.device == torch.device("meta") for p in model.parameters())
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
        for mlp in model:
            api.fully_shard(mlp, reshard_after_forward=raf, mp_policy=mp)
        api.fully_shard(model, reshard_after_forward=raf, mp_policy=mp)
        model.to_empty(device="cpu")
        torch.manual_seed(0)
        for p in model.parameters():
            nn.init.trunc_normal_(p)
        optim = torch.optim.Adam(model.parameters(), lr=1e-2, foreach=True)
        return _steps(model, optim, 3), [_plain(p) for p in model.parameters()]


def case_monkey_patch(api):
    ran = []

    def pre(self, mesh, outer_size, outer_stride, module, mp_policy):
        ran.append(True)
        return (self.to(torch.bfloat16),), None

    @torch.no_grad()
    def post(self, outputs, metadata, param_dtype, *, out=None):
        (tensor,) = outputs
        assert metadata is None, metadata
        assert tensor.dtype == torch.bfloat16, tensor.dtype
        if out is not None:
            with torch.autograd._unsafe_preserve_version_counter(out):
                out.copy_(tensor)
            return None
        up = tensor.to(param_dtype)
        return up, (tensor, up)

    with torch.device("meta"):
        model = two_tensor_mlps()
    for mlp in model:
        api.fully_shard(mlp)
    api.fully_shard(model)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    for p in model.parameters():
        nn.init.trunc_normal_(p)
    weights = [p for n, p in model.named_parameters() if "weight" in n]
    assert weights
    for p in weights:  # on the local tensor objects themselves, after to_empty made them
        local = p._local_tensor
        local.fsdp_pre_all_gather = pre.__get__(local)
        local.fsdp_post_all_gather = post.__get__(local)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2, foreach=True)
    losses = _steps(model, optim, 3)
    assert ran, "the pre-all-gather hook never ran"
    return losses, [_plain(p) for p in model.parameters()]


def case_outer_size_stride(api):
    torch.manual_seed(0)
    model = MLP(dim=3, dim_multiplier=3)
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            if "weight" in name:
                setattr(module, name, nn.Parameter(BF16GatherTensor(p)))
    api.fully_shard(model, reshard_after_forward=False)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    return _steps(model, optim, 1, width=3), [_plain(p) for p in model.parameters()]


def case_hsdp_mesh(api):
    seen = []
    shard = dist.get_world_size() // 2
    mesh = init_device_mesh("cpu", (2, shard), mesh_dim_names=("dp_replicate", "dp_shard"))

    def pre(self, mesh, outer_size, outer_stride, module, mp_policy):
        seen.append(mesh)
        return (self,), None

    @torch.no_grad()
    def post(self, outputs, metadata, param_dtype, *, out=None):
        (tensor,) = outputs
        return None if out is not None else (tensor, (tensor,))

    model = two_tensor_mlps()
    for mlp in model:
        api.fully_shard(mlp, mesh=mesh)
    api.fully_shard(model, mesh=mesh)
    for n, p in model.named_parameters():
        if "weight" in n:
            p._local_tensor.fsdp_pre_all_gather = pre.__get__(p._local_tensor)
            p._local_tensor.fsdp_post_all_gather = post.__get__(p._local_tensor)
    model(torch.randn(2, 8))
    assert seen and all(m.ndim == 1 and m.size() == shard for m in seen), [(m.ndim, m.size()) for m in seen]


CASES = S.Cases2()
for _v in (1, 2):
    for _raf in (True, False):
        CASES.add(case_train_parity, version=_v, raf=_raf, vs_torch=(0, 0))
for _v in (1, 2):
    for _raf in (True, False):
        CASES.add(case_end_to_end, version=_v, raf=_raf, vs_torch=(0, 0))
CASES.add(case_monkey_patch, vs_torch=(0, 0))
CASES.add(case_outer_size_stride, vs_torch=(0, 0))
CASES.add(case_hsdp_mesh, world=4)
XFAIL: dict = {}
FAST = ("train_parity:version=2,raf=True", "outer_size_stride")
SECONDS_PER_CASE = 15.0


@pytest.mark.parametrize("cid", S.H.params(CASES, XFAIL, FAST))
def test_case(cid):
    S.check(__name__, cid)
