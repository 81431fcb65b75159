"""Chapter 6: the mistakes users report, each on torch's FSDP and on ours, at 2 ranks.

For each pitfall the test records what torch does on the same input (the oracle for "torch lets it pass"),
that ours names it (an error or a warning with the fix) where torch is silent, and that the corrected program
stays silent and computes what torch's corrected program computes, bitwise.  One spawn runs every case that
cannot hang (``_workers_pitfalls.pitfalls_worker``); the wrap disagreement, which hangs when its check is
missing, runs in a spawn of its own with a short timeout.
"""

import pytest
import torch

import minifsdp
from tests import _workers_pitfalls as W


@pytest.fixture(scope="module")
def facts():
    return minifsdp.spawn(W.pitfalls_worker, world_size=2, timeout_s=120)


def _on_both(facts, part, key):
    """The same fact on both ranks (a rank that raised alone would have left the other one waiting)."""
    a, b = facts[0][part][key], facts[1][part][key]
    assert type(a) is type(b), (a, b)
    if isinstance(a, tuple) and isinstance(a[0], str):  # an error: the same one on both ranks
        assert a == b, (a, b)
    return a


# ------------------------------------------------------------------ an optimizer built at the wrong time
@pytest.mark.timeout(240)
def test_torch_steps_nothing_with_an_optimizer_built_before_sharding(facts):
    """The oracle: torch FSDP1 (use_orig_params=False) and FSDP2 leave the loss exactly where it was."""
    for key in ("torch_fsdp1_before", "torch_fsdp2_before"):
        for rank in (0, 1):
            before, after = facts[rank]["optimizer"][key]
            assert before == after, key
    trained = facts[0]["optimizer"]["torch_fsdp2_after"]
    assert trained[1] < trained[0]
    # after a forward (with or without grad) FSDP2's root keeps its parameters unsharded: the optimizer holds
    # those of the root's group, so only the separately sharded first layer trains
    for key in ("torch_fsdp2_after_forward", "torch_fsdp2_after_no_grad_forward"):
        partly = facts[0]["optimizer"][key]
        assert partly[0] == trained[0] and trained[1] < partly[1] < partly[0], key


def test_fsdp2_optimizer_built_before_sharding_or_after_a_forward_is_named(facts):
    kind, msg = _on_both(facts, "optimizer", "ours_fsdp2_before")
    assert kind == "RuntimeError" and "before fully_shard replaced it" in msg and "'weight' of Linear" in msg
    assert "Build it after sharding" in msg
    for key in ("ours_fsdp2_after_forward", "ours_fsdp2_after_no_grad_forward"):
        kind, msg = _on_both(facts, "optimizer", key)
        assert kind == "RuntimeError" and "holds the unsharded 'net.2.weight'" in msg, key
        assert "model.reshard()" in msg and "before the first forward" in msg, key


def test_fsdp2_optimizer_built_at_the_right_time_trains_as_torch(facts):
    for when in ("after", "after_reshard"):
        for rank in (0, 1):
            label, losses = facts[rank]["optimizer"][f"ours_fsdp2_{when}"]
            assert label == "trained" and losses == facts[rank]["optimizer"][f"torch_fsdp2_{when}"], when


# ------------------------------------------------------------------ load_state_dict between forward and backward
def test_load_between_forward_and_backward_is_named(facts):
    for kind in ("full", "local"):
        kind_, msg = _on_both(facts, "load", f"ours_{kind}_awaiting")
        assert kind_ == "RuntimeError" and "load_state_dict between a forward and its backward" in msg, kind
        assert "torch.no_grad()" in msg and "after the backward" in msg


def test_torch_ignores_a_local_load_after_any_forward(facts):
    """The oracle: torch FSDP1 loads a LOCAL state dict into the shards, and the next forward still computes with
    the full parameters the root kept from the last forward, with or without grad; a FULL one it writes through
    those parameters, so that one arrives."""
    for rank in (0, 1):
        f = facts[rank]["load"]
        assert f["torch_local_awaiting"] == f["torch_local_no_grad"] == (True, False)
        assert f["torch_full_awaiting"] == f["torch_full_no_grad"] == (False, True)


def test_load_after_a_no_grad_forward_arrives_in_ours(facts):
    """Ours after a no_grad forward: the load arrives, both kinds (the next forward's output is the loaded plain
    model's, bitwise), silently; for FULL bitwise torch's too."""
    for rank in (0, 1):
        f = facts[rank]["load"]
        for kind in ("full", "local"):
            assert f[f"ours_{kind}_no_grad"] == (False, True) and f[f"ours_{kind}_no_grad_warnings"] == [], kind
        assert f["ours_full_no_grad_bitwise_torch"]


# ------------------------------------------------------------------ HYBRID_SHARD over a shard group of 1
def test_hybrid_shard_of_one_synchronises_and_says_so(facts):
    for rank in (0, 1):
        f = facts[rank]["hybrid"]
        assert not f["torch_replicas_equal"], "the oracle: torch FSDP1's replicas drift apart after one step"
        assert any("since the world size is 1" in w for w in f["torch_warnings"])
        assert f["ours_replicas_equal"] and f["ours_bitwise_torch_no_shard"]
        assert len(f["ours_warnings"]) == 1 and "shard group of 1 rank shards nothing" in f["ours_warnings"][0]
        assert "replicas never synchronise" in f["ours_warnings"][0] and "NO_SHARD" in f["ours_warnings"][0]
        assert f["full_shard_warnings"] == []


# ------------------------------------------------------------------ torch.nn.utils.clip_grad_norm_ on flat shards
def test_plain_clip_grad_norm_gives_each_rank_its_own_norm_on_both(facts):
    """Ours = torch's bitwise, both ways; the plain function's norm differs by rank, the FSDP method's is the
    plain model's (to 1e-6: the squares are summed in another order)."""
    plain = facts[0]["clip"]["plain"]
    local = [facts[r]["clip"]["torch"][0] for r in (0, 1)]
    assert not torch.equal(local[0], local[1])
    for rank in (0, 1):
        theirs, ours = facts[rank]["clip"]["torch"], facts[rank]["clip"]["ours"]
        assert len(theirs) == len(ours) == 2 and all(torch.equal(a, b) for a, b in zip(theirs, ours))
        torch.testing.assert_close(ours[1], plain, rtol=1e-6, atol=0)


# ------------------------------------------------------------------ frozen and trainable parameters in one unit
def test_frozen_and_trainable_in_one_flat_parameter_as_torch(facts):
    for rank in (0, 1):
        f = facts[rank]["frozen"]
        assert f["torch_flat"][0] == f["ours_flat"][0] == "ValueError" and "use_orig_params=True" in f["ours_flat"][1]
        their_numel, their_flat, trainable, their_flat_grad, theirs = f["torch_orig"]
        our_numel, our_flat, _, our_flat_grad, ours = f["ours_orig"]
        # use_orig_params=True: the flat gradient covers the whole shard, the frozen numbers included
        assert their_numel == our_numel == their_flat == our_flat
        # each original parameter's gradient (its piece in this shard): bitwise torch's, None where torch has None
        assert len(theirs) == len(ours) == 6
        for a, b in zip(theirs, ours):
            assert (a is None and b is None) or torch.equal(a, b)
        # the whole flat gradient, its frozen part too: what autograd computed for the frozen layer (on rank 0, which
        # holds its 544 numbers), as torch's views of frozen originals are not detached; the optimizer never sees it
        assert torch.equal(their_flat_grad, our_flat_grad)
        assert rank == 1 or our_flat_grad[:544].abs().sum() > 0
    total = sum(facts[r]["frozen"]["ours_orig"][1] for r in (0, 1))
    assert total == sum(p.numel() for p in minifsdp.MLP().parameters()) > facts[0]["frozen"]["ours_orig"][2]


# ------------------------------------------------------------------ FSDP2's zero gradient at world size 1
def test_a_small_sharded_tensor_at_world_size_1_gets_its_gradient(facts):
    """Not reproduced on CPU gloo: torch's and ours give the same non-zero gradient, fp32 and bf16."""
    for rank in (0, 1):
        for label, (theirs, ours) in facts[rank]["small_tensor"].items():
            assert torch.equal(theirs, ours) and theirs.abs().min() > 0, label


# ------------------------------------------------------------------ ranks that disagree on the wrap
@pytest.mark.timeout(120)
def test_ranks_that_wrap_differently_are_named_not_hung():
    """Without the check this spawn hangs in the wrap's first collective until its 20 s timeout."""
    out = minifsdp.spawn(W.wrap_disagreement_worker, world_size=2, timeout_s=20)
    assert out[0]["disagree"] == out[1]["disagree"] and out[0]["disagree"] is not None
    kind, msg = out[0]["disagree"]
    assert kind == "RuntimeError" and "ranks disagree on what this unit wraps" in msg
    assert "rank 0: Linear with 2 parameters (544 elements" in msg and "rank 1: MLP with 6 parameters" in msg
    assert "same auto_wrap_policy on every rank" in msg
    assert all(o["agree_units"] == 3 and o["agree_warnings"] == [] for o in out)


# ------------------------------------------------------------------ torch's checkpoint API on an FSDP1 model
def test_torch_get_state_dict_on_ours_fsdp1_is_refused_with_the_api_to_use(facts):
    """torch's get_state_dict/set_state_dict find FSDP1 by torch's class: on torch FSDP1 they round-trip (sharded:
    ShardedTensor values; full: plain tensors; optimizer state by parameter name), on ours they would read a
    plain module (whole values, state under _flat_param) — ours raises instead, naming the API that works."""
    for rank in (0, 1):
        dcp = facts[rank]["dcp"]
        assert dcp["torch", False][0] == "returned" and dcp["torch", False][1] == ["ShardedTensor"], dcp
        assert dcp["torch", True][0] == "returned" and dcp["torch", True][1] == ["Tensor"], dcp
        assert all(k.endswith(("weight", "bias")) for k in dcp["torch", False][2]), dcp  # by the plain names
        for full in (False, True):
            kind, message = dcp["ours", full]
            assert kind == "TypeError", dcp["ours", full]
            assert "FSDP.state_dict_type" in message and "fully_shard" in message
        assert dcp["ours", "own"] == ["DTensor"]  # ours' own SHARDED dict (DTensor: chapter 6's known entry)
