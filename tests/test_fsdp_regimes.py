"""Regimes beyond the basic step (NO_SHARD + mixed precision, one rank, frozen units, weights tied across
units, no_sync's all-gathers, a step between forward and backward, state dicts gathered unit by unit),
each against torch FSDP1 on the same model, seed, data and wrapping.

Oracle: torch FSDP1 (``device_id=cpu``).  Tolerance: bitwise, in bf16 too: we run torch's
operations (casts, divide factors, collectives) on the same tensors in the same order, so
even the rounding is the same (tests/test_fsdp_parity.py makes the same claim for fp32).
"""

import pytest
import torch

from minifsdp import spawn
from tests import _workers_regimes as W
from tests._workers_fsdp import assert_bitwise

# ---------------------------------------------------------------------- 1. NO_SHARD + MixedPrecision
BF16 = dict(param_dtype=torch.bfloat16)  # reduce_dtype follows param_dtype, as in torch
BF16_FP32_REDUCE = dict(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


@pytest.mark.parametrize("mp", [BF16, BF16_FP32_REDUCE, dict(reduce_dtype=torch.bfloat16)],
                         ids=["bf16", "bf16-fp32-reduce", "bf16-reduce-only"])
@pytest.mark.parametrize("orig", [False, True])
def test_no_shard_mixed_precision_trains_as_torch(mp, orig):
    for r in spawn(W.mixed_precision_no_shard_worker, ("NO_SHARD", mp, orig, False), world_size=2):
        ours, theirs = r["ours"], r["torch"]
        assert_bitwise(ours["losses"], theirs["losses"], "losses")
        assert_bitwise(ours["full"], theirs["full"], "parameters")
        assert ours["grad_dtypes"] == theirs["grad_dtypes"] == [["torch.float32"]] * W.STEPS  # fp32 for the optimizer


@pytest.mark.parametrize("orig", [False, True])
def test_no_shard_mixed_precision_no_sync_accumulates_as_torch(orig):
    """A kept no_sync micro-batch: torch accumulates it in bf16 on flat_param.grad; so do we."""
    for r in spawn(W.mixed_precision_no_shard_worker, ("NO_SHARD", BF16, orig, True), world_size=2):
        assert_bitwise(r["ours"]["losses"], r["torch"]["losses"], "losses")
        assert_bitwise(r["ours"]["full"], r["torch"]["full"], "parameters")


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP"])
def test_one_rank_switches_to_no_shard_and_runs_mixed_precision_as_torch(strategy):
    r = spawn(W.mixed_precision_no_shard_worker, (strategy, BF16, False, False), world_size=1)[0]
    ours, theirs = r["ours"], r["torch"]
    assert ours["strategy"] == theirs["strategy"] == "NO_SHARD"
    assert ours["warnings"] and theirs["warnings"]  # both say so (one per unit)
    assert_bitwise(ours["losses"], theirs["losses"], "losses")
    assert_bitwise(ours["full"], theirs["full"], "parameters")


# ---------------------------------------------------------------------- 2. frozen units
@pytest.mark.parametrize("prefetch,orig", [("BACKWARD_PRE", False), (None, False), ("BACKWARD_POST", True)])
def test_frozen_units_are_freed_right_after_their_backward_as_torch(prefetch, orig):
    """Blocks 1-3 of 0-4 frozen, each its own unit: each is freed once autograd is past it (torch's
    reshard-only hook), so the full parameters alive during the backward are torch's: one block
    (two with a prefetch), not one plus every frozen block met so far."""
    for r in spawn(W.frozen_units_worker, (prefetch, orig), world_size=2):
        ours, theirs = r["ours"], r["torch"]
        assert_bitwise(ours["losses"], theirs["losses"], "losses")
        assert_bitwise(ours["full"], theirs["full"], "parameters")
        assert ours["live"] == theirs["live"]  # at every probe of every backward, the same units alive
        for snapshots in ours["live"]:
            assert [tag for tag, _ in snapshots][:4] == ["after 4", "in 4", "after 3", "in 3"]
            for tag, alive in snapshots:
                i = int(tag.split()[1])  # block i is module 2i + 1 of the Sequential
                done = {str(2 * b + 1) for b in range(i + 1, 5)}  # autograd is past blocks i + 1 .. 4
                assert not done & set(alive), (tag, alive)  # frozen blocks 1-3 included
                if tag.startswith("in"):
                    assert str(2 * i + 1) in alive  # a block's parameters are there for its own backward
        block = 72  # Linear(8, 8)
        assert ours["peak"] == theirs["peak"] == (2 * block if prefetch == "BACKWARD_PRE" else block)
        assert ours["after_backward"] == theirs["after_backward"] == []


# ---------------------------------------------------------------------- 3. a weight tied across units
def test_weight_tied_across_units_trains_as_torch():
    """lm_head its own unit, tok_emb in the root: torch FSDP1 (use_orig_params=False) flattens the tied weight
    twice, once per unit, so the two copies train apart; so do we (and warn); the same numbers everywhere."""
    for r in spawn(W.tied_across_units_worker, (False,), world_size=2):
        ours, theirs = r["ours"], r["torch"]
        assert "error" not in ours and "error" not in theirs, (ours.get("error"), theirs.get("error"))
        assert_bitwise(ours["losses"], theirs["losses"], "losses")
        assert_bitwise(ours["full"], theirs["full"], "parameters")
        assert sorted(ours["state_dict"]) == sorted(theirs["state_dict"])
        for k, v in theirs["state_dict"].items():
            assert torch.equal(ours["state_dict"][k], v), k
        sd = ours["state_dict"]
        assert not torch.equal(sd["tok_emb.weight"], sd["lm_head.weight"])  # the tie is broken, as in torch
        assert ours["warnings"] and "tok_emb.weight" in ours["warnings"][0] and "lm_head.weight" in ours["warnings"][0]


TIED_ORIG_CASES = ((True, "FULL_SHARD", "lm_head"), (True, "NO_SHARD", "tok_emb"), (True, "NO_SHARD", "lm_head"),
                   (True, "NO_SHARD", "tok_emb+lm_head"))


def test_weight_tied_across_units_with_orig_params():
    """use_orig_params=True, one spawn, four cases.  Sharded: torch fails at the forward ('weight' must be 2-D);
    we refuse at wrap time.  NO_SHARD: the other use keeps the original, a whole view of the owner's flat
    parameter, and trains tied, bitwise as torch: tok_emb's unit owning it (lm_head's gradient written back
    before tok_emb's all-reduce: every rank alike), and lm_head's (tok_emb's gradient arrives after lm_head's
    all-reduce and is left out of it, in torch too: the ranks drift), and both units of their own (lm_head's then
    flattens nothing, as torch's, whose ``_get_orig_params`` skips what tok_emb's took).  On more than one rank
    ours warns (wrap time cannot tell which use comes last)."""
    results = spawn(W.tied_across_units_cases, (TIED_ORIG_CASES,), world_size=2)
    sharded = results[0][0]
    assert "must be 2-D" in sharded["torch"]["error"]
    msg = sharded["ours"]["error"]
    assert msg.startswith("ValueError") and "'tok_emb.weight'" in msg and "'lm_head.weight'" in msg
    assert "in one unit" in msg
    for case, own in ((1, "tok_emb"), (2, "lm_head"), (3, "tok_emb+lm_head")):
        for r in (rank[case] for rank in results):
            ours, theirs = r["ours"], r["torch"]
            assert "error" not in ours and "error" not in theirs, (own, ours.get("error"), theirs.get("error"))
            assert_bitwise(ours["losses"], theirs["losses"], f"{own}: losses")
            assert_bitwise(ours["full"], theirs["full"], f"{own}: parameters")
            assert sorted(ours["state_dict"]) == sorted(theirs["state_dict"])
            for k, v in theirs["state_dict"].items():
                assert torch.equal(ours["state_dict"][k], v), (own, k)
            sd = ours["state_dict"]
            assert torch.equal(sd["tok_emb.weight"], sd["lm_head.weight"])  # tied still
            assert "not averaged" in " ".join(ours["warnings"]), ours["warnings"]  # on 2 ranks it may drift
    drift = [not torch.equal(results[0][case]["torch"]["state_dict"]["tok_emb.weight"],
                             results[1][case]["torch"]["state_dict"]["tok_emb.weight"]) for case in (1, 2, 3)]
    assert drift == [False, True, False]  # torch's (and ours): the replicas part where the late gradient missed the sum


# ---------------------------------------------------------------------- 4. all-gathers under no_sync
@pytest.mark.parametrize("strategy", ["SHARD_GRAD_OP", "FULL_SHARD"])
def test_all_gathers_per_micro_batch_under_no_sync_are_torch_s(strategy):
    """SHARD_GRAD_OP keeps its full parameters through no_sync micro-batches (torch's
    _should_free_in_backward) and uses them again at the next forward: no all-gather there."""
    for r in spawn(W.no_sync_all_gathers_worker, (strategy,), world_size=2):
        ours, theirs = r["ours"], r["torch"]
        assert ours["counts"] == theirs["counts"]  # (forward, backward) all-gathers of each micro-batch
        assert_bitwise(ours["losses"], theirs["losses"], "losses")
        assert_bitwise(ours["full"], theirs["full"], "parameters")
        if strategy == "SHARD_GRAD_OP":
            assert ours["counts"][1] == ours["counts"][2] == (0, 0)  # micro-batches 2 and 3: nothing to gather


@pytest.mark.parametrize("strategy", ["SHARD_GRAD_OP", "FULL_SHARD"])
def test_kept_full_parameters_are_gathered_again_after_an_optimizer_step(strategy):
    """Full parameters kept since a no-grad forward are stale once the optimizer steps the shards: we gather
    again (the shard's version counter changed). torch FSDP1 2.13 uses the stale ones here (its losses change
    when a no-grad forward sits between backward and step), so the oracle is our own run without it."""
    for r in spawn(W.stepped_after_no_grad_forward_worker, (strategy,), world_size=2):
        assert_bitwise(r[True]["losses"], r[False]["losses"], "losses")
        assert_bitwise(r[True]["full"], r[False]["full"], "parameters")


# ---------------------------------------------------------------------- 5. state dicts
@pytest.mark.parametrize("orig,rank0_only", [(False, False), (True, False), (False, True)])
def test_full_state_dict_is_gathered_unit_by_unit_as_torch(orig, rank0_only):
    """The same keys in the same order, the same values; at each all-gather the same units already
    alive as in torch (the path from the root, not the whole model); rank0_only: {} elsewhere."""
    results = spawn(W.state_dict_worker, (orig, rank0_only), world_size=2)
    for rank, r in enumerate(results):
        ours, theirs = r["ours"], r["torch"]
        assert ours["keys"] == theirs["keys"]
        assert_bitwise(ours["values"], theirs["values"], "state dict")
        # at the all-gathers of the root, blocks.0, blocks.1 (its buffer allocated as the gather starts):
        # blocks.0 is freed before blocks.1 is gathered
        assert ours["live"] == theirs["live"] == [[], ["blocks.0"], ["blocks.1"]]
        assert ours["after"] == theirs["after"] == []
        if rank0_only and rank:
            assert ours["keys"] == []
        else:
            assert "tok_emb.weight" in ours["keys"] and "lm_head.weight" in ours["keys"]


@pytest.mark.parametrize("orig", [False, True])
def test_load_state_dict_returns_incompatible_keys_as_torch(orig):
    for r in spawn(W.state_dict_worker, (orig, False), world_size=2):
        ours, theirs = r["ours"], r["torch"]
        assert ours["loaded"] == theirs["loaded"] == "<All keys matched successfully>"
        assert_bitwise(ours["after_load"], theirs["after_load"], "loaded parameters")
        assert ours["non_strict"] == theirs["non_strict"] == (
            "_IncompatibleKeys(missing_keys=['ln_f.bias'], unexpected_keys=['head.extra'])")
        assert ours["strict"] == theirs["strict"]  # torch's message, word for word
        assert ours["refused_left_alone"]
