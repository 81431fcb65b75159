"""Port of torch's test_fully_shard_mixed_precision.py: ``MixedPrecisionPolicy``'s compute, reduce and output dtypes.

torch's checks (three MLPs, one group each and the root; 10 iterations; 2 ranks):
- compute dtype bf16 / fp16 (gradients reduced in it): each reduce-scatter's dtype, and parity with a low-precision
  reference whose gradients are reduced by reduce-scatter + all-gather with torch's pre/post divide factors and
  stepped in fp32; ``reshard_after_forward`` in {False, True, 2}, with and without sharding the largest dim;
- reduce dtype fp32 under bf16 compute, and bf16 under fp32 compute, the same way;
- the reduce dtype stays fp32 after a first forward with everything frozen (an int64 parameter in the group);
- gradient accumulation without reduce-scatter in fp32 under bf16 compute;
- dataclass, nested dataclass and NamedTuple activations between sharded modules, fp32 / bf16 / bf16 + fp32 reduce;
- ``torch.func.jvp`` through two modules built on the meta device, ``reshard_after_forward=False``, bf16, no
  warm-up iteration;
- casts: fp16 on one submodule (inputs cast or not, ``output_dtype``), external inputs of a submodule, activation
  checkpointing recomputing the casts of inputs and outputs, norm layers in bf16 / fp16 (batch norm buffers), and a
  model built in bf16 then moved to fp32 still reducing in bf16.
Tolerance: torch's assertEqual (dtype-dependent).
"""

import copy
import dataclasses
import functools
from typing import NamedTuple

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.fsdp._fully_shard._fsdp_collectives import _get_gradient_divide_factors
from torch.distributed.tensor import Shard
from torch.testing._internal.common_distributed import SaveForwardInputsModel
from torch.testing._internal.common_fsdp import MLP
from torch.utils.checkpoint import checkpoint

from tests.torch_suite.fsdp2 import _side as S
from tests.torch_suite.fsdp2.test_frozen import _rs_names

SECONDS_PER_CASE = 8.0


class _ReduceDtype:
    """Asserts the dtype of every reduce-scatter's output while active."""

    def __init__(self, dtype):
        self.dtype, self.saved = dtype, {}

    def __enter__(self):
        for name in _rs_names():
            real = self.saved[name] = getattr(dist, name)

            def rs(output, input, *a, _real=real, **k):
                assert output.dtype == self.dtype, f"reduce-scatter in {output.dtype}, expected {self.dtype}"
                return _real(output, input, *a, **k)
            setattr(dist, name, rs)

    def __exit__(self, *exc):
        for name, fn in self.saved.items():
            setattr(dist, name, fn)


def _largest_dim(p):
    return Shard(max(range(p.ndim), key=lambda d: (p.shape[d], -d)))


def _models(api, raf, param_dtype, reduce_dtype, placement_fn):
    torch.manual_seed(42)
    model = nn.Sequential(*[MLP(16) for _ in range(3)])
    ref = copy.deepcopy(model)
    ref_optim = torch.optim.Adam(ref.parameters(), lr=1e-2)
    shard = functools.partial(api.fully_shard, reshard_after_forward=raf,
                              mp_policy=MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype),
                              shard_placement_fn=_largest_dim if placement_fn else None)
    for mlp in model:
        shard(mlp)
    shard(model)
    return ref, ref_optim, model, torch.optim.Adam(model.parameters(), lr=1e-2, foreach=True)


def _to_fp32_and_step(ref, ref_low, ref_optim):
    for p32, p16 in zip(ref.parameters(), ref_low.parameters()):
        p32.grad = p16.grad.to(p32.dtype)
        p16.grad = None
    ref_optim.step()
    for p32, p16 in zip(ref.parameters(), ref_low.parameters()):
        p16.detach().copy_(p32)


def case_compute_dtype(api, param_dtype, raf, placement_fn):
    ref, ref_optim, model, optim = _models(api, raf, param_dtype, None, placement_fn)
    ref_low = copy.deepcopy(ref).to(param_dtype)
    pre, post, _, _ = _get_gradient_divide_factors(dist.group.WORLD, all_reduce_group=None, reduce_dtype=param_dtype)
    world = dist.get_world_size()
    torch.manual_seed(42 + dist.get_rank() + 1)
    inp = torch.randn(4, 16, dtype=param_dtype)
    for it in range(10):
        optim.zero_grad(set_to_none=(it % 2 == 0))
        loss = model(inp).sum()
        with _ReduceDtype(param_dtype):
            loss.backward()
        optim.step()
        ref_optim.zero_grad(set_to_none=(it % 2 == 0))
        ref_loss = ref_low(inp.to(param_dtype)).sum()
        ref_loss.backward()
        for p in ref_low.parameters():
            if pre is not None and pre > 1:
                p.grad.div_(pre)
            elif pre is None:
                p.grad.div_(world)
            out = torch.zeros_like(torch.chunk(p.grad, world)[0])
            dist.reduce_scatter_single(out, p.grad)
            dist.all_gather_single(p.grad, out)
            if post is not None and post > 1:
                p.grad.div_(post)
        _to_fp32_and_step(ref, ref_low, ref_optim)
        S.assert_equal(loss, ref_loss)
        S.sharded_parity(ref, model)


def case_reduce_dtype(api, reduce_dtype, raf, placement_fn):
    param_dtype = torch.bfloat16 if reduce_dtype == torch.float32 else torch.float32
    ref, ref_optim, model, optim = _models(api, raf, param_dtype, reduce_dtype, placement_fn)
    ref_low = copy.deepcopy(ref).to(param_dtype) if param_dtype != torch.float32 else None
    torch.manual_seed(42 + dist.get_rank() + 1)
    inp = torch.randn(4, 16, dtype=param_dtype)
    for it in range(10):
        optim.zero_grad(set_to_none=(it % 2 == 0))
        loss = model(inp).sum()
        with _ReduceDtype(reduce_dtype):
            loss.backward()
        optim.step()
        ref_optim.zero_grad(set_to_none=(it % 2 == 0))
        if ref_low is not None:  # bf16 compute, fp32 reduction
            ref_loss = ref_low(inp.to(param_dtype)).sum()
            ref_loss.backward()
            for p in ref_low.parameters():
                p.grad.data = p.grad.to(torch.float32)
                dist.all_reduce(p.grad)
                p.grad.div_(dist.get_world_size())
            _to_fp32_and_step(ref, ref_low, ref_optim)
        else:  # fp32 compute, bf16 reduction by reduce-scatter + all-gather
            ref_loss = ref(inp).sum()
            ref_loss.backward()
            for p in ref.parameters():
                sharded = funcol.reduce_scatter_single(p.grad.to(reduce_dtype), scatter_dim=0, reduceOp="avg",
                                                       group=dist.group.WORLD)
                p.grad = funcol.all_gather_single(sharded, gather_dim=0, group=dist.group.WORLD).to(p.dtype)
            ref_optim.step()
        S.assert_equal(loss, ref_loss)
        S.sharded_parity(ref, model)


def case_reduce_dtype_after_frozen_first_forward(api):
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16))
            self.non_float = nn.Parameter(torch.ones(16, dtype=torch.int64), requires_grad=False)

        def forward(self, inp):
            return self.layers(inp)

    model = Model()
    api.fully_shard(model, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    model.requires_grad_(False)
    inp = torch.randn(4, 16)
    with torch.no_grad():
        model(inp)
    model.layers.requires_grad_(True)
    with _ReduceDtype(torch.float32):
        model(inp).sum().backward()
    for p in model.parameters():
        if p.grad is not None:
            assert p.grad.dtype == torch.float32


def case_grad_acc_with_reduce_dtype(api, raf):
    torch.manual_seed(42)
    pd, rd = torch.bfloat16, torch.float32
    mp = MixedPrecisionPolicy(param_dtype=pd, reduce_dtype=rd)
    model = nn.Sequential(*[MLP(16) for _ in range(3)])
    ref = copy.deepcopy(model)
    ref_compute = copy.deepcopy(ref).to(pd)
    ref_optim = torch.optim.Adam(ref.parameters(), lr=1e-2)
    for mlp in model:
        api.fully_shard(mlp, reshard_after_forward=raf, mp_policy=mp)
    api.fully_shard(model, reshard_after_forward=raf, mp_policy=mp)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    torch.manual_seed(42 + dist.get_rank() + 1)
    inp = torch.randn(8, 16, dtype=pd)
    for it in range(10):
        for mb, chunk in enumerate(torch.chunk(inp, 4)):
            last = mb == 3
            model.set_requires_gradient_sync(last)
            model.set_reshard_after_backward(last or raf)
            losses = []
            for m in (ref_compute, model):
                losses.append(m(chunk.detach()).sum())
                assert losses[-1].dtype == pd
                with _ReduceDtype(rd):
                    losses[-1].backward()
            S.assert_equal(losses[0], losses[1])
            for p, pc in zip(ref.parameters(), ref_compute.parameters()):
                p.grad = pc.grad.to(p.dtype) if p.grad is None else p.grad + pc.grad
                pc.grad = None
            if last:
                for p in ref.parameters():
                    dist.all_reduce(p.grad)
                    p.grad /= dist.get_world_size()
        S.sharded_parity(ref, model)
        ref_optim.step()
        optim.step()
        ref_optim.zero_grad(set_to_none=(it % 2 == 0))
        optim.zero_grad(set_to_none=(it % 2 == 0))
        for p, pc in zip(ref.parameters(), ref_compute.parameters()):
            pc.detach().copy_(p)


@dataclasses.dataclass
class DC:
    x: torch.Tensor
    y: torch.Tensor


@dataclasses.dataclass
class Inner:
    x: torch.Tensor
    y: torch.Tensor


@dataclasses.dataclass
class Outer:
    inner: Inner
    z: torch.Tensor


class TensorPair(NamedTuple):
    x: torch.Tensor
    y: torch.Tensor


class _Container(nn.Module):
    def __init__(self, kind, dim):
        super().__init__()
        self.kind, self._layer = kind, nn.Linear(dim, dim)

    def forward(self, inp):
        f = self._layer
        if self.kind == "dataclass":
            return DC(f(inp.x), f(inp.y))
        if self.kind == "nested_dataclass":
            return Outer(Inner(f(inp.inner.x), f(inp.inner.y)), f(inp.z))
        return TensorPair(f(inp.x), f(inp.y))


class _ToContainer(nn.Module):
    def __init__(self, kind):
        super().__init__()
        self.kind = kind

    def forward(self, x):
        if self.kind == "dataclass":
            return DC(x, x.clone())
        if self.kind == "nested_dataclass":
            return Outer(Inner(x, x.clone()), x.clone())
        return TensorPair(x, x.clone())


class _FromContainer(nn.Module):
    def __init__(self, kind):
        super().__init__()
        self.kind = kind

    def forward(self, inp):
        return inp.inner.x + inp.inner.y + inp.z if self.kind == "nested_dataclass" else inp.x + inp.y


def case_structured_input_output(api, container, mp):
    param_dtype, reduce_dtype = {"fp32": (None, None), "bf16": (torch.bfloat16, torch.bfloat16),
                                 "bf16_fp32_reduce": (torch.bfloat16, torch.float32)}[mp]
    torch.manual_seed(42)
    dim, world = 16, dist.get_world_size()
    model = nn.Sequential(_ToContainer(container), _Container(container, dim), _Container(container, dim),
                          _FromContainer(container))
    ref = copy.deepcopy(model)
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    for m in model:
        api.fully_shard(m, mp_policy=policy)
    api.fully_shard(model, mp_policy=policy)
    ref_compute = copy.deepcopy(ref).to(param_dtype) if param_dtype is not None else None
    ref_optim, optim = (torch.optim.Adam(m.parameters(), lr=1e-2) for m in (ref, model))
    torch.manual_seed(1)
    for it in range(10):
        g = torch.rand(world * 2, dim)
        local = g[dist.get_rank() * 2: dist.get_rank() * 2 + 2].detach()
        optim.zero_grad(set_to_none=(it % 2 == 0))
        loss = model(local).sum()
        loss.backward()
        optim.step()
        ref_optim.zero_grad(set_to_none=(it % 2 == 0))
        if ref_compute is not None:
            ref_loss = ref_compute(g.to(param_dtype)).sum()
            ref_loss.backward()
            for p in ref_compute.parameters():
                if reduce_dtype is not None and reduce_dtype != param_dtype:
                    p.grad.data = p.grad.to(reduce_dtype)
                    dist.all_reduce(p.grad)
                p.grad.div_(world)
            _to_fp32_and_step(ref, ref_compute, ref_optim)
        else:
            ref_loss = ref(g).sum()
            ref_loss.backward()
            for p in ref.parameters():
                p.grad.div_(world)
            ref_optim.step()
        dist.all_reduce(loss)
        S.assert_equal(loss, ref_loss)
        if param_dtype is None:
            S.sharded_parity(ref, model)


def case_no_warmup_jvp_reshard_after_forward_false(api):
    dtype = torch.bfloat16
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("fsdp",))
    mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32, cast_forward_inputs=True)
    with torch.device("meta"):
        enc, dec = nn.Linear(128, 256, bias=False), nn.Linear(256, 320, bias=False)
    for m in (enc, dec):
        api.fully_shard(m, mesh=mesh, mp_policy=mp, reshard_after_forward=False)
    gen = torch.Generator("cpu")
    for i, m in enumerate((enc, dec)):
        m.to_empty(device="cpu")
        with torch.no_grad():
            m.weight.normal_(std=m.in_features ** -0.5, generator=gen.manual_seed(42 + i))
    x = torch.randn(128, dtype=dtype, generator=gen.manual_seed(0))
    primal = torch.randn(320, dtype=dtype, generator=gen.manual_seed(1), requires_grad=True)
    tangent = torch.randn(320, dtype=dtype, generator=gen.manual_seed(2))
    e = enc(x)
    out, tangent_out = torch.func.jvp(lambda unused: dec(e), (primal,), (tangent,))
    assert out.shape == (320,) and out.dtype == dtype
    S.assert_equal(tangent_out, torch.zeros_like(out))


def case_float16_on_one_submodule(api):
    x = torch.zeros(2, 100)
    for cast, where, kw, expect in (
            (False, "c2", {"param_dtype": torch.float16}, (torch.float32, torch.float32, torch.float16)),
            (True, "c2", {"param_dtype": torch.float16, "cast_forward_inputs": False},
             (torch.float32, torch.float32, torch.float32)),
            (False, "c1", {"param_dtype": torch.float16, "output_dtype": torch.float32},
             (torch.float32, torch.float16, torch.float32))):
        inputs = {}
        model = SaveForwardInputsModel(inputs, cast_forward_inputs=cast)
        api.fully_shard(getattr(model, where), mp_policy=MixedPrecisionPolicy(**kw))
        api.fully_shard(model)
        model(x).sum().backward()
        got = (inputs[model].dtype, inputs[model.c1].dtype, inputs[model.c2].dtype)
        assert got == expect, (where, kw, got, expect)


def case_submodules_with_external_inputs(api, submodule_cast):
    class ToyModule(nn.Module):
        def __init__(self, seen):
            super().__init__()
            self.l, self.seen = nn.Linear(100, 100), seen

        def forward(self, x, y):
            self.seen["l2_input_x"], self.seen["l2_input_y"] = x, y
            return self.l(x)

    class ToyModel(nn.Module):
        def __init__(self, seen):
            super().__init__()
            self.l1, self.l2, self.seen = nn.Linear(100, 100), ToyModule(seen), seen

        def forward(self, x):
            self.seen["model_input_x"] = x
            return self.l2(self.l1(x), torch.ones(2, 100))

    seen = {}
    model = ToyModel(seen)
    api.fully_shard(model.l2, mp_policy=MixedPrecisionPolicy(param_dtype=torch.float16,
                                                             cast_forward_inputs=submodule_cast))
    api.fully_shard(model, mp_policy=MixedPrecisionPolicy(param_dtype=torch.float16))
    model(torch.zeros(2, 100)).sum().backward()
    assert seen["model_input_x"].dtype == torch.float16 and seen["l2_input_x"].dtype == torch.float16
    assert seen["l2_input_y"].dtype == (torch.float16 if submodule_cast else torch.float32)


def case_checkpoint_recompute_casts(api, recompute_cast):
    class RecordingLinear(nn.Linear):
        def __init__(self):
            super().__init__(1, 1)
            self.input_dtypes = []

        def forward(self, x):
            self.input_dtypes.append(x.dtype)
            return super().forward(x)

    class Model(nn.Module):
        def __init__(self, in_dtype):
            super().__init__()
            self.linear1, self.in_dtype, self.out_dtypes = RecordingLinear(), in_dtype, []

        def ckpt(self, x):
            x = self.linear1(x)
            self.out_dtypes.append(x.dtype)
            return x

        def forward(self, x):
            x = checkpoint(self.ckpt, x.to(dtype=self.in_dtype), use_reentrant=False, early_stop=False)
            return x.float().sum()

    if recompute_cast == "input":
        in_dtype, mp = torch.float32, MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    else:
        in_dtype = torch.bfloat16
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16,
                                  output_dtype=torch.float32, cast_forward_inputs=False)
    torch.manual_seed(42)
    model = Model(in_dtype)
    api.fully_shard(model.linear1, mp_policy=mp)
    api.fully_shard(model, mp_policy=mp)
    model(torch.randn(8, 1)).backward()
    if recompute_cast == "input":
        assert model.linear1.input_dtypes == [torch.bfloat16, torch.bfloat16], model.linear1.input_dtypes
    else:
        assert model.out_dtypes == [torch.float32, torch.float32], model.out_dtypes


def case_norm_modules(api, dtype):
    mp = MixedPrecisionPolicy(param_dtype=dtype)

    def inner(model, x):
        z = model(x)
        assert z.dtype == dtype
        z.sum().backward()

    def every(model, policy=mp):
        for m in (model[0], model[1], model[2], model):
            api.fully_shard(m, mp_policy=policy)
        return model

    inner(every(nn.Sequential(nn.Linear(32, 32), nn.LayerNorm(32), nn.Linear(32, 32))), torch.randn(4, 32))
    inner(every(nn.Sequential(nn.Linear(32, 32), nn.BatchNorm1d(32), nn.Linear(32, 32))), torch.randn(4, 32))

    def conv():
        return nn.Sequential(nn.Conv2d(1, 5, 3), nn.BatchNorm2d(5), nn.Conv2d(5, 4, 3))

    inner(every(conv()), torch.randn(3, 1, 9, 9))
    model = every(conv())
    model[1].running_mean = model[1].running_mean.to(dtype)
    model[1].running_var = model[1].running_var.to(dtype)
    inner(model, torch.randn(3, 1, 9, 9))
    model = conv()
    api.fully_shard(model[1], mp_policy=MixedPrecisionPolicy(output_dtype=dtype))
    for m in (model[0], model[2], model):
        api.fully_shard(m, mp_policy=mp)
    inner(model, torch.randn(3, 1, 9, 9))


def case_clamp_reduce_dtype(api):
    model = nn.Sequential(nn.Linear(32, 32, dtype=torch.bfloat16), nn.Linear(32, 32, dtype=torch.bfloat16))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    for m in model:
        api.fully_shard(m, mp_policy=mp)
    api.fully_shard(model, mp_policy=mp)
    model.to(torch.float32)
    with _ReduceDtype(torch.bfloat16):
        model(torch.randn(4, 32)).sum().backward()


BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
CASES = S.Cases2()
for _pd in (BF16, FP16):
    for _raf in (False, True, 2):
        for _pf in (False, True):
            CASES.add(case_compute_dtype, param_dtype=_pd, raf=_raf, placement_fn=_pf)
for _rd in (FP32, BF16):
    for _raf in (False, True, 2):
        for _pf in (False, True):
            CASES.add(case_reduce_dtype, reduce_dtype=_rd, raf=_raf, placement_fn=_pf)
CASES.add(case_reduce_dtype_after_frozen_first_forward)
for _raf in (True, False):
    CASES.add(case_grad_acc_with_reduce_dtype, raf=_raf)
for _c in ("dataclass", "nested_dataclass", "namedtuple"):
    for _mp in ("fp32", "bf16", "bf16_fp32_reduce"):
        CASES.add(case_structured_input_output, container=_c, mp=_mp)
CASES.add(case_no_warmup_jvp_reshard_after_forward_false)
CASES.add(case_float16_on_one_submodule)
for _sc in (False, True):
    CASES.add(case_submodules_with_external_inputs, submodule_cast=_sc)
for _rc in ("input", "output"):
    CASES.add(case_checkpoint_recompute_casts, recompute_cast=_rc)
for _d in (BF16, FP16):
    CASES.add(case_norm_modules, dtype=_d)
CASES.add(case_clamp_reduce_dtype)
XFAIL: dict = {}
FAST = ("reduce_dtype:reduce_dtype=float32,raf=True,placement_fn=False", "structured_input_output:container="
        "nested_dataclass,mp=bf16_fp32_reduce")


@pytest.mark.parametrize("cid", S.H.params(CASES, XFAIL, FAST))
def test_case(cid):
    S.check(__name__, cid)
