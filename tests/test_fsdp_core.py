"""The core class alone (``minifsdp.fsdp.core.FullyShardedDataParallel``) is bitwise torch FSDP1.

The package a learner reads is ``minifsdp/fsdp/core/``; the class users import extends it.  This
proves the core by itself, with none of the extensions loaded into its units: FULL_SHARD, nested
units (each GPT Block; the MLP's large Linears), AdamW and ``clip_grad_norm_``, at 2 and 3 ranks,
where every flat parameter of the MLP and the GPT needs padding at 3.

Oracle: torch FSDP1 (``use_orig_params=False``, the same nested wrapping), same seed and data.
Tolerance: none, BITWISE for the losses, the clipping norms, each rank's local flat shards and the
full parameters.
"""

import pytest

import minifsdp
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
