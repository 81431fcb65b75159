"""torch's activation checkpointing inside FSDP1 units, on torch FSDP1 and on ours (``tests/_workers_ac_parity.py``).

The recipe torch documents for FSDP1: wrap, then ``apply_activation_checkpointing(model,
checkpoint_wrapper_fn=partial(checkpoint_wrapper, checkpoint_impl=...), check_fn=lambda m: isinstance(m, Block))``,
reentrant and non-reentrant; with and without ``use_orig_params``; FULL_SHARD, SHARD_GRAD_OP, NO_SHARD; world
sizes 1 (each rank on a group of its own), 2 and 3; the root keeping a checkpointed block of its own; a unit inside
a checkpointed block (recomputed inside its own backward); a unit called twice; ``MixedPrecision(param_dtype=bf16)``.

Oracle: torch FSDP1 in the same spawn, same seed, same data.  Bitwise: each step's loss, every gradient (None where
torch's is None), every parameter after the step, and the collectives of each forward and each backward in issue
order (kind, numel, dtype; ``minifsdp.fuzz.record.CollectiveRecorder``).

Where torch is wrong (a unit called twice under *reentrant* checkpointing: torch runs its pre-backward once per
backward, but the reentrant recompute runs the unit's post-backward once per call), the pinned tests assert both
behaviours: torch's failure as it is, and ours against torch *without* checkpointing, which computes the same
gradient in one reduction where ours reduces each call's part apart: fp32 to 1e-6 of the largest gradient (one
more rounding per number), bf16 to 2**-7 of it (bf16 keeps 8 bits: the two parts round apart, about one ulp).
"""

import pytest

from minifsdp import spawn
from tests import _workers_ac_parity as W
from tests._workers_fsdp import assert_bitwise


def _run(world: int, cases: dict, pinned: dict) -> list[dict]:
    results = spawn(W.all_cases, (list(cases), list(pinned)), world_size=world, timeout_s=600)
    assert len(results) == world
    return results


@pytest.fixture(scope="module")
def two_ranks():
    assert all(n.startswith(("reentrant-", "non_reentrant-", "bf16-", "one_rank-", "state_dicts-")) for n in W.CASES_2)
    return _run(2, W.CASES_2, W.PINNED)


@pytest.fixture(scope="module")
def three_ranks():
    return _run(3, W.CASES_3, {})


def _assert_as_torch(per_rank: list[dict], names: list[str]) -> None:
    assert names
    for name in names:
        for rank, res in enumerate(per_rank):
            ours, theirs = res[name]["ours"], res[name]["torch"]
            assert "error" not in theirs, f"{name}, rank {rank}: torch raised {theirs['error']}"
            assert "error" not in ours, f"{name}, rank {rank}: ours raised {ours['error']}"
            assert len(ours["steps"]) == len(theirs["steps"]) == W.STEPS + (ours["states"] is not None)
            assert_bitwise(ours["states"], theirs["states"], f"{name}, rank {rank}: state dicts")
            for i, (o, t) in enumerate(zip(ours["steps"], theirs["steps"])):
                where = f"{name}, rank {rank}, step {i}"
                assert any(t["backward"]), f"{where}: the recorder saw no collective"
                assert o["forward"] == t["forward"], f"{where}: forward collectives"
                assert o["backward"] == t["backward"], f"{where}: backward collectives"
                assert_bitwise(o["loss"], t["loss"], f"{where}: loss")
                assert_bitwise(o["grads"], t["grads"], f"{where}: gradients")
                assert_bitwise(o["params"], t["params"], f"{where}: parameters")


def _names(cases: dict, prefix: str) -> list[str]:
    return [n for n in cases if n.startswith(prefix)]


def test_reentrant_checkpoint_trains_as_torch(two_ranks, three_ranks):
    """The recompute runs inside the backward: it reads the names the pre-backward set, and the gradient reaches
    the flat parameter only through the forward's views (use_orig_params); a block of the root's is reduced in
    the recompute's backward and again in the outer one (NO_SHARD: the first all-reduce done before the second)."""
    _assert_as_torch(two_ranks, _names(W.CASES_2, "reentrant-"))
    _assert_as_torch(three_ranks, _names(W.CASES_3, "reentrant-"))


def test_fuzzer_seed_25_trains_as_torch(three_ranks):
    """The program the fuzzer found: manual units, forward_prefetch, use_orig_params, a frozen block."""
    _assert_as_torch(three_ranks, ["seed25"])


def test_non_reentrant_checkpoint_trains_as_torch(two_ranks, three_ranks):
    """A unit inside a checkpointed block runs its forward again inside its own backward: as torch's
    ``_pre_forward``/``_post_forward``, that forward gathers nothing, frees nothing and hooks nothing.  And a
    checkpointed unit called twice."""
    _assert_as_torch(two_ranks, _names(W.CASES_2, "non_reentrant-"))
    _assert_as_torch(three_ranks, _names(W.CASES_3, "non_reentrant-"))


def test_state_dicts_of_a_checkpointed_model_use_torch_s_names(two_ranks):
    """torch's state dicts (FULL, SHARDED, LOCAL) and optimizer state dict name a parameter as the plain model does:
    the checkpoint wrapper's ``_checkpoint_wrapped_module.`` goes, as FSDP's own prefix (``clean_tensor_name``)."""
    _assert_as_torch(two_ranks, _names(W.CASES_2, "state_dicts-"))


def test_checkpoint_under_bf16_mixed_precision_trains_as_torch(two_ranks):
    _assert_as_torch(two_ranks, _names(W.CASES_2, "bf16-"))


def test_checkpoint_on_one_rank_trains_as_torch(two_ranks):
    _assert_as_torch(two_ranks, _names(W.CASES_2, "one_rank-"))


# ---------------------------------------------------------------------- where torch is wrong
def _assert_ours_as_plain_torch(per_rank: list[dict], name: str, rel: float) -> None:
    """Ours (checkpointed) against torch without checkpointing: losses of step 0 bitwise (the forward is the
    same), every gradient of step 0 within ``rel`` of the largest (None where torch's is None)."""
    for rank, res in enumerate(per_rank):
        ours, plain = res[name]["ours"], res[name]["torch_plain"]
        assert "error" not in ours and "error" not in plain, (rank, ours.get("error"), plain.get("error"))
        assert_bitwise(ours["steps"][0]["loss"], plain["steps"][0]["loss"], f"rank {rank}: loss")
        o, p = ours["steps"][0]["grads"], plain["steps"][0]["grads"]
        assert [n.replace("_checkpoint_wrapped_module.", "") for n, _ in o] == [n for n, _ in p]
        for (n, g), (_, ref) in zip(o, p, strict=True):
            assert (g is None) == (ref is None), f"rank {rank} {n}: {g is None} vs {ref is None}"
            if g is not None:
                bound = rel * ref.abs().max().item()
                assert (g.float() - ref.float()).abs().max().item() <= bound, f"rank {rank} {n}"


def test_unit_called_twice_reentrant_torch_reads_freed_parameters_ours_trains(two_ranks):
    """torch: the later call's recompute runs the unit's post-backward (its parameters freed), the pre-backward
    does not run again for the earlier call, whose recompute reads freed storage
    (``_runtime_utils._pre_backward_hook``: ``_ran_pre_backward_hook``)."""
    name = "twice-reentrant-FULL_SHARD-orig0"
    for res in two_ranks:
        kind, message = res[name]["torch"]["error"]
        assert kind == "RuntimeError" and "setStorage" in message and "storage of size 0" in message, message
    _assert_ours_as_plain_torch(two_ranks, name, rel=1e-6)


def test_unit_called_twice_reentrant_bf16_torch_drops_the_gradient_ours_trains(two_ranks):
    """torch: under MixedPrecision each forward's low-precision flat parameter has its own AccumulateGrad, the
    post-backward hook sits on the first forward's (``_register_post_backward_hook``), and both recomputes reach
    the last forward's views (``flat_param._tensors``): the hook never runs and the unit gets no gradient."""
    name = "twice-reentrant-bf16-FULL_SHARD-orig1"
    for rank, res in enumerate(two_ranks):
        theirs, plain = res[name]["torch"], res[name]["torch_plain"]
        assert "error" not in theirs, theirs.get("error")
        dropped = [n for (n, g), (_, ref) in zip(theirs["steps"][0]["grads"], plain["steps"][0]["grads"], strict=True)
                   if g is None and ref is not None]
        assert dropped and all(".blocks.1." in n for n in dropped), (rank, dropped)
    _assert_ours_as_plain_torch(two_ranks, name, rel=2 ** -7)


def test_unit_called_twice_reentrant_no_shard_orig_params_torch_leaves_a_part_unreduced_ours_trains(two_ranks):
    """torch: after the later call's post-backward (NO_SHARD keeps the parameters) the names are the original
    parameters again (``_use_sharded_views``), so the earlier call's recompute accumulates into their ``.grad``
    past the flat parameter's hook: that part stays this rank's own, never all-reduced."""
    name = "twice-reentrant-NO_SHARD-orig1"
    for rank, res in enumerate(two_ranks):
        theirs, plain = res[name]["torch"], res[name]["torch_plain"]
        assert "error" not in theirs, theirs.get("error")
        far = [n for (n, g), (_, ref) in zip(theirs["steps"][0]["grads"], plain["steps"][0]["grads"], strict=True)
               if g is not None and (g - ref).abs().max() > 1e-3 * ref.abs().max()]
        assert far and all(".blocks.1." in n for n in far), (rank, far)
    _assert_ours_as_plain_torch(two_ranks, name, rel=1e-6)
