"""Port of torch's test_fsdp_hybrid_shard.py, at 4 ranks: shard within a "node" of 2, replicate across.

What torch's file checks, and how here:
- HYBRID_SHARD and _HYBRID_SHARD_ZERO2 with an explicit (intra-node, inter-node) process-group pair
  train TransformerWithSharedParams as DDP does, with and without use_orig_params;
- each rank's local share of every unit is the 1/2 shard of its intra-node group (torch's shapes);
- the same with a 2 x 2 ``device_mesh`` instead of the pair;
- between forward and backward a non-root unit's full parameter is freed (HYBRID_SHARD) or kept
  (_HYBRID_SHARD_ZERO2: SHARD_GRAD_OP inside the group), freed after the backward, as in torch.
Groups: intra {0,1},{2,3}; inter {0,2},{1,3}.  Oracle: DDP over all 4 ranks (inputs seeded by the
intra-node rank, as torch's model does when given a pair), and torch FSDP1 for the shard shapes.
Tolerance: assert_close fp32 defaults.
"""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import ShardingStrategy
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.testing._internal.common_fsdp import TransformerWithSharedParams

from tests.torch_suite import _harness as H
from tests.torch_suite import _workers as W

_GROUPS: dict = {}


def _pair():
    """(intra, inter) for this rank; built once per process (every rank must create every group)."""
    if "pair" not in _GROUPS:
        intra, _ = dist.new_subgroups_by_enumeration([[0, 1], [2, 3]])
        inter, _ = dist.new_subgroups_by_enumeration([[0, 2], [1, 3]])
        _GROUPS["pair"] = (intra, inter)
    return _GROUPS["pair"]


def case_ddp_parity(api, strategy, orig, how):
    pair = _pair()
    ref_local = TransformerWithSharedParams.init(pair, *W.DEFAULT_MODES, deterministic=True)
    ddp = DDP(ref_local)
    ref_loss = W.train(ddp, 2)
    kw = dict(sharding_strategy=strategy, use_orig_params=orig)
    if how == "pair":
        fsdp = api.init(TransformerWithSharedParams, kw, group=pair)
    else:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        model = TransformerWithSharedParams.init(pair, *W.DEFAULT_MODES, deterministic=True)
        fsdp = api.wrap(model, device_mesh=mesh, **kw)
    loss = W.train(fsdp, 2)
    torch.testing.assert_close(loss, ref_loss, msg=lambda m: f"loss vs DDP: {m}")
    got, want = api.full_params(fsdp), [p.detach() for p in ddp.parameters()]
    assert len(got) == len(want), f"{len(got)} vs DDP's {len(want)}"
    for i, (a, b) in enumerate(zip(got, want)):
        torch.testing.assert_close(a, b, msg=lambda m, i=i: f"parameter {i} vs DDP: {m}")
    return [tuple(p.shape) for p in fsdp.parameters()]  # each rank's local shares: torch's


def _resident(api, unit) -> bool:
    """Whether ``unit``'s all-gathered (padded, full) flat parameter holds memory now."""
    h = unit._handle
    full = h.padded if api.ours else h.flat_param._full_param_padded
    return full.untyped_storage().size() > 0


def case_reshard_after_forward(api, strategy):
    """Between forward and backward each non-root unit's full parameter is freed (HYBRID_SHARD, ZeRO-3 in the
    group) or kept (_HYBRID_SHARD_ZERO2, ZeRO-2 in the group); after the backward every one is freed."""
    fsdp = api.init(TransformerWithSharedParams, dict(sharding_strategy=strategy), group=_pair())
    inp = fsdp.module.get_input(W.CPU)
    loss = fsdp.module.get_loss(inp, fsdp(*inp))
    units = [m for m in api.FSDP.fsdp_modules(fsdp) if m is not fsdp and m._handle is not None]
    assert units, "no non-root unit"
    between = [_resident(api, m) for m in units]
    fsdp.module.run_backward(loss)
    after = [_resident(api, m) for m in units]
    want = strategy == ShardingStrategy._HYBRID_SHARD_ZERO2
    assert between == [want] * len(units), f"full parameters resident between forward and backward: {between}"
    assert after == [False] * len(units), f"full parameters resident after the backward: {after}"
    return between, after


CASES = W.Cases()
for _s in (ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2):
    for _o in (False, True):
        for _h in ("pair", "mesh"):
            CASES.add(case_ddp_parity, strategy=_s, orig=_o, how=_h, world=4, vs_torch=(0, 0))
    CASES.add(case_reshard_after_forward, strategy=_s, world=4, vs_torch=(0, 0))

XFAIL: dict = {}
FAST = ("ddp_parity:strategy=HYBRID_SHARD,orig=True,how=pair@4",)


@pytest.mark.parametrize("cid", H.params(CASES, XFAIL, FAST))
def test_case(cid):
    H.check(__name__, cid)
