"""Port of torch's test_fsdp_summon_full_params.py: ``FSDP.summon_full_params`` and its options.

What torch's file checks, and how here (NestedWrappedModule, whose units nest, unless said):
- inside, every parameter has its original shape and the local model's value; after, shapes are back;
  names and buffers read as the local model's (no wrapper prefixes) [strategy x use_orig_params];
- ``writeback=True`` keeps what was written inside, ``writeback=False`` drops it, except under NO_SHARD
  where the full parameter is the shard (torch documents that) [x strategy x orig];
- ``recurse=False`` unshards only the unit itself: the names and shapes seen are torch's;
- ``rank0_only=True``: rank 0 sees the full values, the others their own view (as torch);
  ``offload_to_cpu=True``; each as torch: the names, shapes and values seen on every rank;
- ``with_grads=True`` (use_orig_params=True) shows the full gradients, equal to DDP's;
- errors with torch's types: inside forward, inside backward, nested on the same unit,
  ``rank0_only`` with ``writeback``, ``with_grads`` without ``use_orig_params``;
- called on a plain module that holds units, and on a one-parameter model.
Oracles: the local model (values, names), DDP (gradients), torch FSDP1 (what each rank sees, error types).
Tolerance: bitwise for values copied in and out; assert_close fp32 defaults for DDP's gradients.
"""

import pytest
import torch
import torch.nn as nn
from torch.distributed.fsdp import ShardingStrategy
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.testing._internal.common_fsdp import NestedWrappedModule, TransformerWithSharedParams

from tests._workers_fsdp import assert_bitwise
from tests.torch_suite import _harness as H
from tests.torch_suite import _workers as W

STRATEGIES = (ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP, ShardingStrategy.NO_SHARD)


def _model(api, strategy=ShardingStrategy.FULL_SHARD, orig=False, **kw):
    return api.init(NestedWrappedModule, dict(sharding_strategy=strategy, use_orig_params=orig, **kw))


def case_full_values_and_names(api, model, strategy, orig):
    cls = {"nested": NestedWrappedModule, "transformer": TransformerWithSharedParams}[model]
    local = W.local_model(cls)
    fsdp = api.init(cls, dict(sharding_strategy=strategy, use_orig_params=orig))
    outside = [tuple(p.shape) for p in fsdp.parameters()]
    with api.FSDP.summon_full_params(fsdp):
        got = [(n, p.detach().clone()) for n, p in fsdp.named_parameters()]
        bufs = [(n, b.detach().clone()) for n, b in fsdp.named_buffers()]
    ref = list(local.named_parameters())
    assert [n for n, _ in got] == [n for n, _ in ref], f"names {[n for n, _ in got]} vs local {[n for n, _ in ref]}"
    for (n, a), (_, b) in zip(got, ref):
        assert_bitwise(a, b.detach(), n)
    ref_bufs = list(local.named_buffers())
    assert [n for n, _ in bufs] == [n for n, _ in ref_bufs], f"buffers {[n for n, _ in bufs]} vs local"
    assert [tuple(p.shape) for p in fsdp.parameters()] == outside, "shapes after the context differ from before"


def case_writeback(api, writeback, strategy, orig):
    fsdp = _model(api, strategy, orig)
    before = api.full_params(fsdp)
    with api.FSDP.summon_full_params(fsdp, writeback=writeback):
        with torch.no_grad():
            for i, p in enumerate(fsdp.parameters()):
                p.fill_(float(i + 3))  # the same on every rank
    after = api.full_params(fsdp)
    kept = writeback or strategy == ShardingStrategy.NO_SHARD  # torch's docs: NO_SHARD writes land anyway
    expected = [torch.full_like(b, float(i + 3)) for i, b in enumerate(before)] if kept else before
    assert_bitwise(after, expected, f"full parameters after writeback={writeback}")
    inp = fsdp.module.get_input(W.CPU)
    fsdp(*inp).sum().backward()  # the model still trains after the context


def case_recurse_false(api, orig):
    fsdp = _model(api, orig=orig)
    with api.FSDP.summon_full_params(fsdp, recurse=False):
        seen = [(n, tuple(p.shape)) for n, p in fsdp.named_parameters()]
    return seen


def case_rank0_only_offload(api, rank0_only, offload, strategy, orig):
    fsdp = _model(api, strategy, orig)
    if offload and not api.ours and strategy == ShardingStrategy.FULL_SHARD:
        # torch FSDP1 on CPU cannot offload a CPU tensor "to CPU": it frees the full parameter it still reads
        # (an error on one rank, a crash or a hang on the other).  On CPU the offload moves nothing, so the
        # oracle is torch without it.  (With NO_SHARD torch refuses the offload: that case is skipped.)
        offload = False
    with api.FSDP.summon_full_params(fsdp, writeback=False, rank0_only=rank0_only, offload_to_cpu=offload):
        seen = [(n, p.detach().clone()) for n, p in fsdp.named_parameters()]
    if not rank0_only or torch.distributed.get_rank() == 0:
        ref = list(W.local_model(NestedWrappedModule).named_parameters())
        assert_bitwise([(n, p) for n, p in seen], [(n, p.detach()) for n, p in ref], "full parameters")
    return seen


def case_with_grads(api, strategy):
    ddp = DDP(W.local_model(NestedWrappedModule))
    fsdp = _model(api, strategy, orig=True)
    for m in (ddp, fsdp):
        inp = m.module.get_input(W.CPU)
        m.module.get_loss(inp, m(*inp)).backward()
    with api.FSDP.summon_full_params(fsdp, with_grads=True):
        grads = [None if p.grad is None else p.grad.detach().clone() for p in fsdp.parameters()]
    ref = [p.grad for p in ddp.parameters()]
    assert len(grads) == len(ref), f"{len(grads)} gradients vs DDP's {len(ref)}"
    for i, (g, r) in enumerate(zip(grads, ref)):
        assert g is not None, f"gradient {i} is None inside summon_full_params(with_grads=True)"
        torch.testing.assert_close(g, r, msg=lambda m, i=i: f"gradient {i} vs DDP: {m}")


class _SummonsInForward(nn.Module):
    """Calls summon_full_params on the wrapped model it is given as an argument, as torch's test does.
    (Kept as an attribute, the wrapper would become a submodule of its own child: a module cycle, on
    which torch's lazy init recurses without end.)"""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 4)

    def forward(self, x, fsdp_module):
        with fsdp_module.summon_full_params(fsdp_module):
            pass
        return self.lin(x)


def case_errors_as_torch(api, where):
    if where == "forward":
        fsdp = api.wrap(_SummonsInForward())
        return W.error_of(lambda: fsdp(torch.randn(2, 4), fsdp))
    fsdp = _model(api, orig=where == "with_grads_orig")
    inp = fsdp.module.get_input(W.CPU)
    if where == "backward":
        out = fsdp(*inp)

        def hook(grad):
            with api.FSDP.summon_full_params(fsdp):
                pass
            return grad
        out.register_hook(hook)
        return W.error_of(lambda: out.sum().backward())
    if where == "nested":
        def nested():
            with api.FSDP.summon_full_params(fsdp):
                with api.FSDP.summon_full_params(fsdp):
                    pass
        return W.error_of(nested)
    if where == "rank0_only_writeback":
        def both():
            with api.FSDP.summon_full_params(fsdp, rank0_only=True, writeback=True):
                pass
        return W.error_of(both)
    if where in ("with_grads_flat", "with_grads_orig"):
        def grads():
            with api.FSDP.summon_full_params(fsdp, with_grads=True):
                pass
        return W.error_of(grads)
    raise ValueError(where)


def case_from_plain_module(api, orig):
    local = W.local_model(NestedWrappedModule)
    model = api.init(NestedWrappedModule, dict(use_orig_params=orig), wrap_root=False)  # no root unit
    assert not isinstance(model, api.FSDP)
    with api.FSDP.summon_full_params(model):
        got = [(n, p.detach().clone()) for n, p in model.named_parameters()]
    assert_bitwise([p for _, p in got], [p.detach() for p in local.parameters()], "full parameters")
    return [n for n, _ in got]  # with no root unit, the names keep the wrappers' prefixes, as torch's


def case_single_parameter(api, orig):
    class One(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.arange(5.0))

        def forward(self, x):
            return x * self.w

    fsdp = api.wrap(One(), use_orig_params=orig)
    with api.FSDP.summon_full_params(fsdp):
        seen = [(n, p.detach().clone()) for n, p in fsdp.named_parameters()]
    assert_bitwise(seen, [("w", torch.arange(5.0))], "the one parameter")


CASES = W.Cases()
for _m in ("nested", "transformer"):
    for _s in STRATEGIES:
        for _o in (False, True):
            CASES.add(case_full_values_and_names, model=_m, strategy=_s, orig=_o)
for _w in (True, False):
    for _s in STRATEGIES:
        for _o in (False, True):
            CASES.add(case_writeback, writeback=_w, strategy=_s, orig=_o)
for _o in (False, True):
    CASES.add(case_recurse_false, orig=_o, vs_torch=(0, 0))
    for _r0, _off in ((True, False), (False, True), (True, True)):
        for _s in (ShardingStrategy.FULL_SHARD, ShardingStrategy.NO_SHARD):
            CASES.add(case_rank0_only_offload, rank0_only=_r0, offload=_off, strategy=_s, orig=_o, vs_torch=(0, 0))
    CASES.add(case_from_plain_module, orig=_o, vs_torch=(0, 0))
    CASES.add(case_single_parameter, orig=_o)
for _s in STRATEGIES:
    CASES.add(case_with_grads, strategy=_s)
for _w in ("forward", "backward", "nested", "rank0_only_writeback", "with_grads_flat", "with_grads_orig"):
    CASES.add(case_errors_as_torch, where=_w, vs_torch=(0, 0))

XFAIL: dict = {}
FAST = ("writeback:writeback=True,strategy=FULL_SHARD,orig=False",
        "full_values_and_names:model=transformer,strategy=FULL_SHARD,orig=True")


@pytest.mark.parametrize("cid", H.params(CASES, XFAIL, FAST))
def test_case(cid):
    H.check(__name__, cid)
