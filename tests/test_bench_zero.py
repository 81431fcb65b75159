"""The DeepSpeed ZeRO bench (``minifsdp/bench/zero.py``): what it measures is what it says.

Without deepspeed (not a dependency of this project) the FSDP half still runs: the census after one step must
be FSDP's model state to the byte (oracle: ``minifsdp.memory.zero_formulas.fsdp_model_state_bytes``, exercise
2.3b's count: shards with padding x 16 bytes + AdamW's step tensors; plus the model's buffers, kept whole), and
every trainer's first loss the same (the same model and batch; torch FSDP1 and ours are bitwise equal).  With
deepspeed installed, its ZeRO-2 joins: the same first loss within 1e-6 (its reduction adds in another order).
"""

import pytest

from minifsdp.bench import zero as bench_zero
from minifsdp.launch import spawn
from minifsdp.memory.zero_formulas import fsdp_model_state_bytes
from minifsdp.models import GPTConfig, TinyGPT


def test_the_deepspeed_config_sets_the_buckets_it_says():
    zero3 = bench_zero.ds_config(3, 2, 1000)["zero_optimization"]
    assert zero3 == {"stage": 3, "reduce_bucket_size": 1000, "allgather_bucket_size": 1000,
                     "stage3_prefetch_bucket_size": 1000}
    assert bench_zero.ds_config(2, 2, None)["zero_optimization"] == {"stage": 2}  # --ds-defaults
    assert bench_zero.DDP_BUCKET_ELEMENTS * 4 == 25 * 2**20


@pytest.mark.timeout(300)
def test_the_census_after_a_step_is_fsdps_model_state_to_the_byte():
    names = ["fsdp1_full", "ours_full", "ours_grad_op"]
    per_rank = spawn(bench_zero.zero_rank, (names, "tiny", 2, 0, 1, None), world_size=2)
    units = [4160, 12704, 12704]  # the tiny GPT's root and its two blocks (chapter 3.1's table)
    buffers = sum(b.numel() * b.element_size() for b in TinyGPT(GPTConfig.tiny()).buffers())  # attention masks, whole
    assert buffers > 0
    for r in per_rank:
        assert sorted(r["state"]) == sorted(names)
        for name in names:
            assert r["state"][name]["model_state_bytes"] == fsdp_model_state_bytes(units, 2) + buffers, r["state"]
        assert len({r["first_loss"][n] for n in names}) == 1, r["first_loss"]


@pytest.mark.timeout(600)
def test_deepspeed_zero2_trains_the_same_first_step():
    pytest.importorskip("deepspeed")
    per_rank = spawn(bench_zero.zero_rank, (["ds_zero2", "fsdp1_full"], "tiny", 2, 0, 1, None), world_size=2)
    for r in per_rank:
        assert abs(r["first_loss"]["ds_zero2"] - r["first_loss"]["fsdp1_full"]) < 1e-6, r["first_loss"]
