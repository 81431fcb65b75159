"""Deferred initialisation (a model built on the meta device) and sync_module_states, as torch FSDP1.

Oracle: torch FSDP1 (``torch.distributed.fsdp.FullyShardedDataParallel``, ``device_id=torch.device("cpu")``,
``use_orig_params=False``) given the same meta-device TinyGPT, the same ``auto_wrap_policy`` (each Block) and
the same ``param_init_fn`` (``minifsdp.fsdp.deferred_init.tinygpt_param_init_fn``: exactly ``TinyGPT(cfg,
seed=0)``'s weights, one module at a time); torch FSDP1's meta path runs on CPU here.  Compared on every rank:
the modules ``param_init_fn`` is called on (order and their meta tensors), each unit's local shard after the
wrap, the full weights (also against the plain ``TinyGPT(seed=0)``), then 3 AdamW steps: losses, local shards,
full weights.  The ``reset_parameters()`` path (no ``param_init_fn``) on Linear/LayerNorm units, same global seed.

Tolerance: bitwise everywhere.  Same numbers in, same flat layout, same collectives (gloo), same ops.
Planted faults: ``param_init_fn`` with another seed (the shard and weight comparisons see it); a
``param_init_fn`` that materialises the whole model at its first call (the memory check sees it); a rank that
does not sync (its weights differ from rank 0's).

Peak memory during the wrap (``minifsdp.memory.MemoryTracker``, live tensor bytes less what was alive before):
a 6-block TinyGPT at 2 ranks, measured 260,224 bytes for ours and for torch FSDP1, against 327,680 bytes for the
full model (parameters + masks); the greedy fault 403,904.  The check: peak < full model, and peak <= what the
rank keeps at the end (its shards + buffers) + two copies of the largest unit (the originals and the flat
parameter being concatenated).

sync_module_states: torch FSDP1's refuses CPU tensors ("requires them to be on GPU"; shown below), so its oracle
is the plain ``TinyGPT(seed=0)`` (rank 0's seed).  World sizes 2 and 3 (3 divides neither unit: padded shards).
"""

from __future__ import annotations

import pytest

from minifsdp.launch import spawn
from tests._workers_deferred_init import cases
from tests._workers_fsdp import assert_bitwise, bitwise_differences

CASES_2 = ["parity", "reset", "memory", "sync", "errors"]
CASES_3 = ["parity", "sync"]


@pytest.fixture(scope="module")
def ranks2():
    return spawn(cases, (CASES_2,), world_size=2, timeout_s=300)


@pytest.fixture(scope="module")
def ranks3():
    return spawn(cases, (CASES_3,), world_size=3, timeout_s=300)


def _case(ranks, name):
    out = []
    for r, res in enumerate(ranks):
        value = res[name]
        if isinstance(value, tuple) and value and value[0] == "error":
            pytest.fail(f"case {name!r} failed on rank {r}:\n{value[2]}")
        out.append(value)
    return out


def by_name(state: dict) -> dict:
    """A state dict in name order: these tests compare each name's numbers, not the order the dicts list them in
    (one side lists the buffers after every parameter, the other in module order)."""
    return dict(sorted(state.items()))


@pytest.fixture(params=[2, 3], ids=["ws2", "ws3"])
def ranks(request):
    return request.getfixturevalue(f"ranks{request.param}")


def test_param_init_fn_called_on_the_modules_torch_calls_it_on(ranks2):
    for p in _case(ranks2, "parity"):
        ours, theirs = p["ours"]["calls"], p["torch"]["calls"]
        assert ours == theirs and len(ours) == 26
        # each Block unit first (breadth first inside it), then the root, which stops at the Block units
        assert ours[0] == ("Block", 0) and ours[1] == ("LayerNorm", 2) and ours[20] == ("TinyGPT", 0)
        assert ("CausalSelfAttention", 1) in ours  # its causal-mask buffer is meta too
        assert sum(name == "Block" for name, _ in ours) == 2


def test_meta_init_local_shards_equal_torch_fsdp1(ranks):
    for p in _case(ranks, "parity"):
        assert len(p["ours"]["shards"]) > 0
        assert_bitwise(p["ours"]["shards"], p["torch"]["shards"], "local shards after the wrap")
        assert len(p["fault"]["shards"]) == len(p["torch"]["shards"])
        assert bitwise_differences(p["fault"]["shards"], p["torch"]["shards"])  # another seed: seen


def test_meta_init_weights_equal_the_plain_seeded_model(ranks):
    for p in _case(ranks, "parity"):
        assert len(p["reference"]) > 0
        ref = by_name(p["reference"])  # TinyGPT(cfg, seed=0), built whole
        assert_bitwise(by_name(p["ours"]["full_at_wrap"]), ref, "ours")
        assert_bitwise(by_name(p["torch"]["full_at_wrap"]), ref, "torch FSDP1")
        assert sorted(p["fault"]["full"]) == sorted(p["reference"])
        assert bitwise_differences(p["fault"]["full"], p["reference"])  # another seed: seen


def test_training_after_meta_init_equals_torch_fsdp1(ranks):
    for p in _case(ranks, "parity"):
        assert len(p["ours"]["losses"]) == len(p["torch"]["losses"]) == 3
        assert p["ours"]["losses"] == p["torch"]["losses"]
        assert_bitwise(p["ours"]["shards_after"], p["torch"]["shards_after"], "local shards after 3 steps")
        assert_bitwise(by_name(p["ours"]["full_after"]), by_name(p["torch"]["full_after"]), "full weights, 3 steps")
        assert sorted(p["ours"]["full_after"]) == sorted(p["reference"])
        assert bitwise_differences(p["ours"]["full_after"], p["reference"])  # it trained


def test_tied_weight_survives_meta_init(ranks):
    for p in _case(ranks, "parity"):
        assert p["ours"]["tied"] and p["torch"]["tied"]  # lm_head.weight is tok_emb.weight inside summon
        # one copy in the root's flat parameter: same size as torch's, which deduplicates a tie
        assert p["ours"]["shards"][0].numel() == p["torch"]["shards"][0].numel()


def test_a_fn_that_breaks_the_tie_is_warned_about(ranks2):
    for e in _case(ranks2, "errors"):
        assert e["tie_broken"]  # torch's to_empty on both modules: two tensors, as torch FSDP1
        assert len(e["tie_warning"]) == 1 and "'tok_emb.weight' and 'lm_head.weight'" in e["tie_warning"][0]


def test_reset_parameters_path_equals_torch_fsdp1(ranks2):
    for r in _case(ranks2, "reset"):
        assert len(r["ours"]["shards"]) > 0
        assert_bitwise(r["ours"]["shards"], r["torch"]["shards"], "local shards after the wrap")
        assert len(r["ours"]["losses"]) == 3 and r["ours"]["losses"] == r["torch"]["losses"]
        assert_bitwise(r["ours"]["shards_after"], r["torch"]["shards_after"], "local shards after 3 steps")


def _holds_one_unit_at_a_time(m: dict, full_bytes: int, largest_unit_bytes: int) -> bool:
    return m["peak"] < full_bytes and m["peak"] <= m["at_rest"] + 2 * largest_unit_bytes


def test_no_rank_holds_the_full_model_during_the_wrap(ranks2):
    from minifsdp.models import Block, GPTConfig

    block_bytes = 4 * sum(p.numel() for p in Block(GPTConfig()).parameters())  # the largest unit (fp32)
    for m in _case(ranks2, "memory"):
        full = m["full_bytes"]
        assert full == 327_680
        assert _holds_one_unit_at_a_time(m["ours"], full, block_bytes), m
        assert _holds_one_unit_at_a_time(m["torch"], full, block_bytes), m
        # Measured: equal (260,224 bytes) in every local run; once in CI ours peaked 104 bytes above torch
        # (260,328), a small tensor alive during the wrap that we could not reproduce.  A unit's worth
        # of difference (tens of KB) is what this guards against, so 1 KiB of slack keeps it meaningful.
        assert m["ours"]["peak"] <= m["torch"]["peak"] + 1024, m
        assert m["ours"]["at_rest"] == m["torch"]["at_rest"]
        assert not _holds_one_unit_at_a_time(m["ours_greedy"], full, block_bytes), m  # the fault is caught
        assert m["ours_greedy"]["peak"] >= full


def test_sync_module_states_gives_every_rank_rank0s_weights(ranks):
    for rank, s in enumerate(_case(ranks, "sync")):
        assert len(s["reference"]) > 0
        assert_bitwise(by_name(s["meta"]), by_name(s["reference"]), "meta-built")  # seed=rank, synced to seed 0's
        assert s["meta_tied"]
        assert_bitwise(by_name(s["plain"]), by_name(s["reference10"]), "built whole")  # seed 10 + rank
        assert s["unsynced_differs"] == (rank != 0)  # without the sync a rank's weights are not rank 0's


def test_torch_fsdp1_sync_module_states_needs_a_gpu(ranks2):
    for s in _case(ranks2, "sync"):
        kind, msg = s["torch_cpu"]
        assert kind == "ValueError" and "requires them to be on GPU" in msg


def test_a_meta_tensor_left_behind_is_named(ranks2):
    for e in _case(ranks2, "errors"):
        kind, msg = e["meta_left"]
        assert kind == "RuntimeError" and "attn.causal_mask (CausalSelfAttention)" in msg and "meta" in msg


def test_reset_path_names_a_module_without_reset_parameters(ranks2):
    for e in _case(ranks2, "errors"):
        kind, msg = e["no_reset"]
        assert kind == "AttributeError" and "'attn' (CausalSelfAttention)" in msg and "param_init_fn" in msg
        kind, msg = e["not_callable"]
        assert kind == "ValueError" and "callable" in msg


def test_sync_module_states_with_different_shapes_is_an_error_not_a_hang(ranks2):
    for rank, e in enumerate(_case(ranks2, "errors")):
        kind, msg = e["shape"]
        assert kind == "ValueError" and "differ in shape" in msg and f"weight (this rank ({4 + rank}, 4)" in msg
        kind, msg = e["count"]
        assert kind == "ValueError" and "different numbers" in msg
        assert e["after"] == [10]  # the group still works: nothing was left half-sent
