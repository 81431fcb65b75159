"""Port of torch's test_fsdp_mixed_precision.py and test_fsdp_sharded_grad_scaler.py (the CPU parts).

What torch's files check, and how here (observed through hooks and public state, not torch's internals):
- inside forward each Linear computes with ``param_dtype`` weights; BatchNorm buffers are in
  ``buffer_dtype``; BatchNorm (in ``_module_classes_to_ignore``) gets fp32 inputs under an auto-wrap
  policy; the output dtype; after backward the gradients are in the parameters' fp32 (fp16 with
  ``keep_low_precision_grads``); outside forward the parameters are fp32 again — all as torch's
  [param/reduce/buffer dtype sets x strategy x use_orig_params];
- two training steps give torch's loss and full parameters;
- ShardedGradScaler: training with it gives torch's losses, parameters and scale; its getters
  (scale, growth/backoff factors, interval, enabled) and ``state_dict()`` are torch's;
- torch's parity test with the scaler (``TestShardedGradScalerParityWithDDP``): NestedWrappedModule, or with
  ``use_orig_params`` torch's NonUniformReqGradNWM (everything frozen but its last unit's second Linear, so the
  first units see no gradient at all), each step ending in a full state-dict round trip through zeroed
  parameters [strategy x fp16 MixedPrecision x use_orig_params]; and, with that model, what
  ``named_parameters()`` holds right after the backward.
Oracle: torch FSDP1 (and torch's ShardedGradScaler); DDP for the scaler parity without mixed precision.
Tolerance: 1e-3 (fp16 compute) for the first cases; bitwise against torch FSDP1 for the scaler parity (the same
operations on the same numbers), assert_close's fp32 defaults against DDP (it all-reduces where FSDP
reduce-scatters); dtypes, names and shapes exact.
"""

import pytest
import torch
import torch.nn as nn
from torch.distributed.fsdp import MixedPrecision, ShardingStrategy
from torch.distributed.fsdp.wrap import ModuleWrapPolicy
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.testing._internal.common_fsdp import NestedWrappedModule, NonUniformReqGradNWM

from tests.torch_suite import _harness as H
from tests.torch_suite import _workers as W

CONFIGS = {
    "all16": dict(param_dtype=torch.float16, reduce_dtype=torch.float16, buffer_dtype=torch.float16),
    "param16_reduce32": dict(param_dtype=torch.float16, reduce_dtype=torch.float32, buffer_dtype=torch.float16),
    "bf16": dict(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16, buffer_dtype=torch.bfloat16),
    "keep_low": dict(param_dtype=torch.float16, reduce_dtype=torch.float16, keep_low_precision_grads=True),
}


class _BNNet(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin1, self.bn, self.lin2 = nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Linear(8, 4)

    def forward(self, x):
        return self.lin2(torch.relu(self.bn(self.lin1(x))))


def case_dtypes(api, config, strategy, orig):
    model = _BNNet()
    seen = []
    for name, m in model.named_modules():
        if isinstance(m, nn.Linear):
            m.register_forward_pre_hook(lambda mod, a, name=name: seen.append((name, "weight", str(mod.weight.dtype))))
        if isinstance(m, nn.BatchNorm1d):
            m.register_forward_pre_hook(lambda mod, a, name=name: seen.append(
                (name, "in/buf", str(a[0].dtype), str(mod.running_mean.dtype))))
    fsdp = api.wrap(model, sharding_strategy=strategy, use_orig_params=orig,
                    mixed_precision=MixedPrecision(**CONFIGS[config]),
                    auto_wrap_policy=ModuleWrapPolicy({nn.Linear}))
    torch.manual_seed(1 + torch.distributed.get_rank())
    out = fsdp(torch.randn(4, 6))
    out.sum().backward()
    grads = [str(p.grad.dtype) for p in fsdp.parameters() if p.grad is not None]
    params = [str(p.dtype) for p in fsdp.parameters()]
    return {"forward": seen, "out": str(out.dtype), "grads": grads, "params": params}


def case_training(api, config, strategy, orig):
    fsdp = api.init(NestedWrappedModule, dict(sharding_strategy=strategy, use_orig_params=orig,
                                              mixed_precision=MixedPrecision(**CONFIGS[config])))
    loss = W.train(fsdp, 2)
    return {"loss": loss, "params": api.full_params(fsdp)}


def case_sharded_grad_scaler(api, strategy, orig):
    mp = MixedPrecision(**CONFIGS["param16_reduce32"])
    fsdp = api.init(NestedWrappedModule, dict(sharding_strategy=strategy, use_orig_params=orig, mixed_precision=mp))
    scaler = api.ShardedGradScaler(device="cpu", init_scale=2.0 ** 10, growth_interval=1)
    losses = [W.train(fsdp, 1, scaler=scaler) for _ in range(3)]
    getters = {k: getattr(scaler, k)() for k in ("get_scale", "get_growth_factor", "get_backoff_factor",
                                                 "get_growth_interval", "is_enabled")}
    sd = scaler.state_dict()
    return {"losses": losses, "params": api.full_params(fsdp), "getters": getters, "state": sd}


def _scaler_model(orig):
    """torch's choice in its scaler parity test: NonUniformReqGradNWM with use_orig_params (a conservative
    ``init_scale``, as torch sets it, against infs in the first steps), NestedWrappedModule without."""
    return (NonUniformReqGradNWM, 2.0 ** 11) if orig else (NestedWrappedModule, 2.0 ** 16)


def case_grad_scaler_parity(api, strategy, mp, orig):
    """torch's ``test_fsdp_ddp_parity_with_grad_scaler`` on CPU: 2 SGD steps with the sharded scaler, each ending
    in ``state_dict()``, zeroed parameters, ``load_state_dict()``; the loss and full parameters as DDP's (no mixed
    precision, as torch checks them) and returned for the bitwise comparison with torch FSDP1."""
    model_cls, init_scale = _scaler_model(orig)
    kw = dict(sharding_strategy=strategy, use_orig_params=orig,
              mixed_precision=MixedPrecision(**CONFIGS["all16"]) if mp else None)
    fsdp = api.init(model_cls, kw)
    loss = W.train(fsdp, 2, scaler=api.ShardedGradScaler(device="cpu", init_scale=init_scale), save_load=api)
    params = api.full_params(fsdp)
    if not mp:
        ddp = DDP(W.local_model(model_cls))
        ref_loss = W.train(ddp, 2, scaler=W.TorchShardedGradScaler(device="cpu", init_scale=init_scale))
        torch.testing.assert_close(loss, ref_loss, msg=lambda m: f"loss vs DDP: {m}")
        ref = [p.detach() for p in ddp.parameters()]
        assert len(params) == len(ref), f"{len(params)} full parameters vs DDP's {len(ref)}"
        for i, (a, b) in enumerate(zip(params, ref)):
            torch.testing.assert_close(a, b, msg=lambda m, i=i: f"parameter {i} vs DDP: {m}")
    return {"loss": loss, "params": params}


def case_params_after_backward_with_frozen_units(api, strategy):
    """NonUniformReqGradNWM with use_orig_params: its first two units are frozen and see no gradient (their inputs
    need none), so no backward hook of theirs runs.  Right after the backward, every name ``named_parameters()``
    yields is what torch shows (this rank's 1-D piece between steps), and its storage is allocated."""
    fsdp = api.init(NonUniformReqGradNWM, dict(sharding_strategy=strategy, use_orig_params=True))
    inp = fsdp.module.get_input(W.CPU)
    fsdp.module.get_loss(inp, fsdp(*inp)).backward()
    seen = [(n, tuple(p.shape), p.untyped_storage().nbytes() >= (p.storage_offset() + p.numel()) * p.element_size())
            for n, p in fsdp.named_parameters()]
    stale = [n for n, _, allocated in seen if not allocated]
    assert not stale, f"after the backward these parameters are views of freed storage: {stale}"
    return seen


CASES = W.Cases()
for _c in CONFIGS:
    for _s in (ShardingStrategy.FULL_SHARD, ShardingStrategy.NO_SHARD):
        for _o in (False, True):
            CASES.add(case_dtypes, config=_c, strategy=_s, orig=_o, vs_torch=(0, 0))
            CASES.add(case_training, config=_c, strategy=_s, orig=_o, vs_torch=(1e-3, 1e-3))
for _s in (ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP, ShardingStrategy.NO_SHARD):
    for _o in (False, True):
        CASES.add(case_sharded_grad_scaler, strategy=_s, orig=_o, vs_torch=(1e-3, 1e-3))

for _s in (ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP):
    CASES.add(case_params_after_backward_with_frozen_units, strategy=_s, vs_torch=(0, 0))
for _s in (ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP):
    for _mp in (False, True):
        for _o in (False, True):
            CASES.add(case_grad_scaler_parity, strategy=_s, mp=_mp, orig=_o, vs_torch=(0, 0))

# Fixed by the core's rewrite: SHARD_GRAD_OP + use_orig_params, a frozen unit no gradient reaches kept
# its forward's full-shape views after the final callback freed their storage (a SIGSEGV in grad_scaler_parity);
# OrigParams.after_reshard now restores the sharded views at every reshard but the forward's own.
XFAIL: dict = {}
FAST = ("dtypes:config=param16_reduce32,strategy=FULL_SHARD,orig=True",)


@pytest.mark.parametrize("cid", H.params(CASES, XFAIL, FAST))
def test_case(cid):
    H.check(__name__, cid)
