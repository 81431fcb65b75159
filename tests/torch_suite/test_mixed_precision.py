"""Port of torch's test_fsdp_mixed_precision.py and test_fsdp_sharded_grad_scaler.py (the CPU parts).

What torch's files check, and how here (observed through hooks and public state, not torch's internals):
- inside forward each Linear computes with ``param_dtype`` weights; BatchNorm buffers are in
  ``buffer_dtype``; BatchNorm (in ``_module_classes_to_ignore``) gets fp32 inputs under an auto-wrap
  policy; the output dtype; after backward the gradients are in the parameters' fp32 (fp16 with
  ``keep_low_precision_grads``); outside forward the parameters are fp32 again — all as torch's
  [param/reduce/buffer dtype sets x strategy x use_orig_params];
- two training steps give torch's loss and full parameters;
- ShardedGradScaler: training with it gives torch's losses, parameters and scale; its getters
  (scale, growth/backoff factors, interval, enabled) and ``state_dict()`` are torch's.
Oracle: torch FSDP1 (and torch's ShardedGradScaler).  Tolerance: 1e-3 (fp16 compute); dtypes exact.
"""

import pytest
import torch
import torch.nn as nn
from torch.distributed.fsdp import MixedPrecision, ShardingStrategy
from torch.distributed.fsdp.wrap import ModuleWrapPolicy
from torch.testing._internal.common_fsdp import NestedWrappedModule

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


CASES = W.Cases()
for _c in CONFIGS:
    for _s in (ShardingStrategy.FULL_SHARD, ShardingStrategy.NO_SHARD):
        for _o in (False, True):
            CASES.add(case_dtypes, config=_c, strategy=_s, orig=_o, vs_torch=(0, 0))
            CASES.add(case_training, config=_c, strategy=_s, orig=_o, vs_torch=(1e-3, 1e-3))
for _s in (ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP, ShardingStrategy.NO_SHARD):
    for _o in (False, True):
        CASES.add(case_sharded_grad_scaler, strategy=_s, orig=_o, vs_torch=(1e-3, 1e-3))

XFAIL: dict = {}
FAST = ("dtypes:config=param16_reduce32,strategy=FULL_SHARD,orig=True",)


@pytest.mark.parametrize("cid", H.params(CASES, XFAIL, FAST))
def test_case(cid):
    H.check(__name__, cid)
