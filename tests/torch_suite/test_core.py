"""Port of torch's test_fsdp_core.py: FSDP trains as DDP does, on each of torch's test models.

What torch's file checks, and how here:
- parity with DDP (losses after 2 SGD-momentum steps, then every full parameter, with a state-dict
  round trip through zeroed parameters each step) for NestedWrappedModule (3 strategies x backward
  prefetch None/PRE/POST x forward prefetch x use_orig_params), the always-wrap variant,
  TransformerWithSharedParams (tied weights, buffers, BatchNorm), MixtureOfExperts (experts on a
  1-rank group; the reference is torch's DummyDDP with the model's own gradient all-reduce; torch's
  side gets ``device_id`` by default there, see ``_workers.fsdp1_defaults_to_cpu``), and the delayed
  variants (the delays are CUDA sleeps, so here they run undelayed; ``test_delays.py`` makes them real);
- one mixed-precision iteration (fp16 params, reductions, buffers): loss and parameters against torch FSDP1;
- a parameter changed in place after wrapping shows in the next forward;
- eval under ``torch.no_grad()`` gives the output of eval with autograd on.
Oracle: DDP (torch's); tolerance: assert_close's fp32 defaults (see ``_workers.ddp_parity``).
"""

import contextlib

import pytest
import torch
from torch.distributed.fsdp import BackwardPrefetch, MixedPrecision, ShardingStrategy
from torch.testing._internal.common_fsdp import (
    AlwaysWrapNestedWrappedModule,
    DummyDDP,
    MixtureOfExperts,
    NestedWrappedModule,
    NestedWrappedModuleWithDelay,
    TransformerWithSharedParams,
)

from tests.torch_suite import _harness as H
from tests.torch_suite import _workers as W

MODELS = {"nested": NestedWrappedModule, "always_wrap": AlwaysWrapNestedWrappedModule,
          "transformer": TransformerWithSharedParams, "moe": MixtureOfExperts,
          "delay_after_loss": NestedWrappedModuleWithDelay, "delay_before_reduction": NestedWrappedModuleWithDelay}
STRATEGIES = (ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP, ShardingStrategy.NO_SHARD)
PREFETCH = (None, BackwardPrefetch.BACKWARD_PRE, BackwardPrefetch.BACKWARD_POST)


def case_ddp_parity(api, model, strategy, prefetch=BackwardPrefetch.BACKWARD_PRE, fwd_prefetch=False, orig=False):
    kw = dict(sharding_strategy=strategy, backward_prefetch=prefetch, forward_prefetch=fwd_prefetch,
              use_orig_params=orig)
    init_kw = {"delay_after_loss": {"delay_after_loss_ms": 250},
               "delay_before_reduction": {"delay_before_reduction_ms": 250}}.get(model, {})
    on_cpu = W.fsdp1_defaults_to_cpu() if (model == "moe" and not api.ours) else contextlib.nullcontext()
    with on_cpu:
        W.ddp_parity(api, MODELS[model], kw, ref_wrap=DummyDDP if model == "moe" else None, init_kw=init_kw)


def case_mixed_precision_one_step(api, model, strategy, orig=False):
    """torch: one iteration with fp16 parameters, reductions and buffers, whose loss matches DDP under
    autocast.  On CPU torch FSDP1's own loss is not close to DDP's under CPU autocast, so the oracle here is
    torch FSDP1 itself: the same step's loss and full parameters (fp16 compute: rtol = atol = 1e-3)."""
    mp = MixedPrecision(param_dtype=torch.float16, reduce_dtype=torch.float16, buffer_dtype=torch.float16)
    model = api.init(MODELS[model], dict(sharding_strategy=strategy, use_orig_params=orig, mixed_precision=mp))
    loss = W.train(model, 1)
    assert loss.dtype == torch.float16, f"loss in {loss.dtype}, not the param_dtype float16"
    return {"loss": loss, "params": api.full_params(model)}


def case_param_change_after_init(api):
    model = api.init(TransformerWithSharedParams)
    model.eval()
    inp = model.module.get_input(W.CPU)
    before = model(*inp).detach().clone()
    with torch.no_grad():
        with api.FSDP.summon_full_params(model):
            first = next(model.parameters())
            torch.manual_seed(3)
            first.normal_()
    after = model(*inp)
    assert not torch.allclose(before, after), "the forward did not see the parameter changed after wrapping"


def case_no_grad_eval(api):
    model = api.init(TransformerWithSharedParams)
    W.train(model, 1)
    model.eval()
    inp = model.module.get_input(W.CPU)
    with_grad = model(*inp)
    with torch.no_grad():
        without = model(*inp)
    torch.testing.assert_close(without, with_grad)  # same ops, same order: equal in practice
    return without


CASES = W.Cases()
for _s in STRATEGIES:
    for _p in PREFETCH:
        for _f in (False, True):
            for _o in (False, True):
                CASES.add(case_ddp_parity, model="nested", strategy=_s, prefetch=_p, fwd_prefetch=_f, orig=_o)
for _m in ("always_wrap", "transformer", "moe", "delay_after_loss", "delay_before_reduction"):
    for _s in STRATEGIES:
        for _o in (False, True):
            CASES.add(case_ddp_parity, model=_m, strategy=_s, orig=_o)
for _m in ("nested", "transformer"):
    for _s in STRATEGIES:
        for _o in (False, True):
            CASES.add(case_mixed_precision_one_step, model=_m, strategy=_s, orig=_o, vs_torch=(1e-3, 1e-3))
CASES.add(case_param_change_after_init)
CASES.add(case_no_grad_eval, vs_torch=(0, 0))

XFAIL: dict = {}
FAST = ("ddp_parity:model=nested,strategy=FULL_SHARD,prefetch=BACKWARD_PRE,fwd_prefetch=False,orig=False",
        "ddp_parity:model=transformer,strategy=SHARD_GRAD_OP,orig=True")


@pytest.mark.parametrize("cid", H.params(CASES, XFAIL, FAST))
def test_case(cid):
    H.check(__name__, cid)
