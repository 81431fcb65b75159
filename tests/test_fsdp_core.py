"""The core class alone (``minifsdp.fsdp.core.FullyShardedDataParallel``) is bitwise torch FSDP1.

The package a learner reads is ``minifsdp/fsdp/core/``; the class users import extends it.  This
proves the core by itself, with none of the extensions loaded into its units: FULL_SHARD, nested
units (each GPT Block; the MLP's large Linears), AdamW and ``clip_grad_norm_`` (``minifsdp/fsdp/full_params.py``'s,
on the core's units), at 2 and 3 ranks, where every flat parameter of the MLP and the GPT needs padding at 3.

Oracle: torch FSDP1 (``use_orig_params=False``, the same nested wrapping), same seed and data.
Tolerance: none, BITWISE for the losses, the clipping norms, each rank's local flat shards and the
full parameters.
"""

import pytest

import minifsdp
from minifsdp.fsdp.core import ShardingStrategy
from tests import _workers_core as C
from tests._workers_fsdp import assert_same_training

KINDS = ["gpt", "mlp"]


@pytest.fixture(scope="module", params=[2, 3], ids=lambda n: f"{n}ranks")
def runs(request):
    return request.param, minifsdp.spawn(C.core_vs_torch_worker, args=(KINDS,), world_size=request.param,
                                         timeout_s=300)


@pytest.mark.parametrize("kind", KINDS)
def test_core_class_alone_is_bitwise_torch_fsdp1(runs, kind):
    world, results = runs
    assert len(results) == world
    for rank, res in enumerate(results):
        r = res[kind]
        built = r["built"]
        assert built["classes"] == ["FullyShardedDataParallel@minifsdp.fsdp.core.fsdp"], built
        assert built["exact_handle"] and built["handles"] == ["minifsdp.fsdp.core.handle.FlatParamHandle"], built
        if world == 3:  # sizes no world size divides: the padding is part of what is compared
            assert any(p > 0 for p in built["padding"]), built["padding"]
        assert_same_training(r["ours"], r["torch"], f"rank {rank} {kind}", kind)


# ---------------------------------------------------------------------- a strategy as data, against torch's own sets
@pytest.mark.parametrize("name", ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "_HYBRID_SHARD_ZERO2"])
def test_sharding_plan_answers_as_torch_fsdp1_decides(name):
    """One process: each plan's answers against the sets and the factor torch FSDP1's runtime reads
    (``_flat_param.py``'s RESHARD_AFTER_FORWARD_HANDLE_STRATEGIES, ``_init_utils.py``'s HYBRID_SHARDING_STRATEGIES,
    ``DefaultState._get_gradient_predivide_factor``), and the table ``print`` shows."""
    from torch.distributed.algorithms._comm_hooks import default_hooks
    from torch.distributed.fsdp import ShardingStrategy as TorchStrategy
    from torch.distributed.fsdp._flat_param import RESHARD_AFTER_FORWARD_HANDLE_STRATEGIES, HandleShardingStrategy
    from torch.distributed.fsdp._init_utils import HYBRID_SHARDING_STRATEGIES

    from minifsdp.fsdp.core import ShardingPlan

    plan = ShardingPlan.of(ShardingStrategy[name])
    assert plan.strategy is ShardingStrategy[name] and ShardingPlan.of(None).strategy is ShardingStrategy.FULL_SHARD
    assert plan.frees_after_forward == (HandleShardingStrategy[name] in RESHARD_AFTER_FORWARD_HANDLE_STRATEGIES)
    assert plan.two_groups == (TorchStrategy[name] in HYBRID_SHARDING_STRATEGIES)
    assert plan.shards_params == plan.frees_after_backward == (name != "NO_SHARD")  # torch: uses_sharded_strategy
    assert (not plan.reduce_scatters) == (name == "NO_SHARD") and plan.all_reduces == (
        name == "NO_SHARD" or plan.two_groups)
    for n in (1, 2, 3, 4, 6, 8, 16):
        pre, post = ShardingPlan.of(ShardingStrategy[name], n).divide_factors()
        assert pre == default_hooks.DefaultState._get_gradient_predivide_factor(n) and pre * post == n, n
    text = str(ShardingPlan.of(ShardingStrategy[name], 3)).splitlines()
    assert text[0] == f"ShardingPlan {name}" and text[-1].split()[:4] == ["divide", "(N", "=", "3)"], text
    with pytest.raises(ValueError, match="needs N"):
        plan.divide_factors()
