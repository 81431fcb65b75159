"""Saving and resuming through FSDP1's state dicts gives what torch FSDP1 gives, on every rank.

Oracle: torch FSDP1 (``torch.distributed.fsdp``, ``device_id=cpu``, gloo) running the same user code
(``tests/_workers_sd_parity.py``) in the same ranks, on the same seeds and data; every comparison is
bitwise (``tests._workers_fsdp.assert_bitwise``: keys in order, types, dtypes, shapes, bytes).  3 ranks (no
flat parameter of the test model divides by 3: shards end in padding); HYBRID_SHARD on 4 (2 replicas of 2).

1. A parameter FSDP does not manage (``ignored_modules``) is each rank's own, and so is its optimizer state:
   ``FSDP.optim_state_dict`` gives each rank its own, ``optim_state_dict_to_load`` loads what each rank
   passed (with ``rank0_only``, rank 0's); the round trip resumes the run exactly.
2. ``FullStateDictConfig(rank0_only=True)``: which keys each rank gets.  torch tests the rank within the
   unit's shard group (``_common_unshard_post_state_dict_hook``: ``fsdp_state.rank``), keeps on the others
   what no unit with parameters holds (the ignored module's parameters, a buffer of a root without
   parameters), and ignores the config under NO_SHARD (``_replace_with_full_state_dict_type``).  The
   optimizer's ``rank0_only`` tests the rank in ``group`` (all ranks).
3. Where torch is wrong: with ``use_orig_params=True`` on CPU at ``offload_to_cpu=True`` (the default),
   torch's optimizer state dict gives AdamW's ``exp_avg`` equal to ``exp_avg_sq``; ours gives torch's own
   ``offload_to_cpu=False`` answer, and resumes exactly where torch's diverges.
4. A ``ShardedGradScaler`` saved between two growth steps (and after a backoff) resumes as torch's.
5. Under NO_SHARD every rank holds a whole optimizer state: each rank saves its own (torch gathers nothing
   there), which shows when the replicas' states differ.
"""

import pytest
import torch

from minifsdp import spawn
from tests import _workers_sd_parity as W
from tests._workers_fsdp import assert_bitwise

THREE = [("save_and_resume", "FULL_SHARD", False), ("save_and_resume", "FULL_SHARD", True),
         ("rank0_only", "NO_SHARD", False, "Net"), ("rank0_only", "FULL_SHARD", True, "BareRoot"),
         ("scaler",), ("replicas_apart", False), ("replicas_apart", True)]
FOUR = [("save_and_resume", "HYBRID_SHARD", True)]  # (the flat-parameter path: FULL_SHARD on 3 ranks)
SAVES = [c for c in THREE + FOUR if c[0] == "save_and_resume"]


def _spawn(cases, world):
    results = spawn(W.run_cases, (cases,), world_size=world, timeout_s=300)
    assert len(results) == world
    return results


@pytest.fixture(scope="module")
def three():
    return _spawn(THREE, 3)


@pytest.fixture(scope="module")
def four():
    return _spawn(FOUR, 4)


def _per_rank(request, case) -> list[tuple[dict, dict]]:
    """(ours, torch's) on each rank of ``case``'s spawn, neither an error."""
    results = request.getfixturevalue("four" if case in FOUR else "three")
    out = []
    for rank, per_rank in enumerate(results):
        res = per_rank[case]
        for side in W.SIDES:
            assert "error" not in res[side], f"rank {rank}, {side}: {res[side]['error']}"
        out.append((res["ours"], res["torch"]))
    return out


def _ids(case) -> str:
    return "-".join(str(c) for c in case)


def _managed(osd: dict) -> dict:
    return {k: v for k, v in osd["state"].items() if not k.startswith("ign.")}


@pytest.mark.parametrize("case", SAVES, ids=_ids)
def test_ignored_parameters_optimizer_state_is_each_rank_s_own_as_torch(request, case):
    both = _per_rank(request, case)
    for rank, (ours, theirs) in enumerate(both):
        for key in ("osd rank0_only=False", "osd rank0_only=True", "full_optim_state_dict"):
            if key in theirs:
                assert_bitwise(ours[key], theirs[key], f"rank {rank} {key}")
    # the ranks' own states differ (each trained its copy on its own data), so the test can tell them apart
    first, second = (both[r][1]["osd rank0_only=False"]["state"]["ign.weight"]["exp_avg"] for r in (0, 1))
    assert not torch.equal(first, second)
    assert list(both[1][1]["osd rank0_only=True"]) == []  # torch's rank0_only: rank 0 of all ranks only
    assert list(both[-1][1]["osd rank0_only=True"]) == []


@pytest.mark.parametrize("case", SAVES, ids=_ids)
def test_resume_through_optim_state_dict_as_torch(request, case):
    """Saved, loaded into a fresh model and optimizer, trained on: as torch's, and (without rank0_only, where
    every rank gets its own ignored state back) exactly the run that never stopped."""
    for rank, (ours, theirs) in enumerate(_per_rank(request, case)):
        for key in ("resumed rank0_only=False", "resumed rank0_only=True", "continued"):
            assert_bitwise(ours[key], theirs[key], f"rank {rank} {key}")
        assert_bitwise(ours["resumed rank0_only=False"], ours["continued"], f"rank {rank} resumed vs continued")


@pytest.mark.parametrize("case", [c for c in THREE + FOUR if c[0] not in ("scaler", "replicas_apart")], ids=_ids)
def test_rank0_only_keys_and_values_on_every_rank_as_torch(request, case):
    """The model's FULL state dict with ``rank0_only`` (ours with ``offload_to_cpu=True`` too) and the
    optimizer's, on every rank."""
    keys = ("msd rank0_only=True", "msd rank0_only=True offload", "msd rank0_only=False", "msd", "msd offload",
            "osd")
    for rank, (ours, theirs) in enumerate(_per_rank(request, case)):
        for key in keys:
            if key in theirs:
                assert_bitwise(ours[key], theirs[key], f"rank {rank} {key}")
    res = _per_rank(request, case)[1][1]
    kept = list(res.get("msd rank0_only=True", res.get("msd")))
    if case[1] == "NO_SHARD":  # every rank gets it all
        assert kept == list(_per_rank(request, case)[0][1]["msd"])
    elif case[-1] == "BareRoot":  # rank 1: the ignored module's parameters, the root's buffer
        assert kept == ["scale", "ign.weight", "ign.bias"]
    else:
        assert kept == ["ign.weight", "ign.bias"]
    if case[1] == "HYBRID_SHARD":  # rank 2 is rank 0 of its shard group: it keeps the whole dict
        assert list(_per_rank(request, case)[2][1]["msd rank0_only=True"]) == \
            list(_per_rank(request, case)[0][1]["msd rank0_only=True"])


@pytest.mark.parametrize("case", [c for c in SAVES if c[2]], ids=_ids)
def test_torch_orig_params_optim_state_dict_offloaded_on_cpu_repeats_exp_avg_sq(request, case):
    """torch is wrong here, ours is right; this pins both (a torch that fixes it fails this test).

    torch FSDP1, ``use_orig_params=True``, AdamW, ``FullOptimStateDictConfig()`` (``offload_to_cpu=True``):
    ``_optim_utils._allgather_orig_param_states`` all-gathers each state name of a unit into one reused
    buffer and keeps views of it (``_unflatten_orig_param_states``: ``value.cpu()`` is no copy on CPU), so
    ``exp_avg`` holds ``exp_avg_sq``'s numbers and a resume from it diverges.  Ours gives torch's own
    ``offload_to_cpu=False`` answer and resumes exactly."""
    for rank, (ours, theirs) in enumerate(_per_rank(request, case)):
        wrong, right = _managed(theirs["osd offload"]), _managed(theirs["osd rank0_only=False"])
        assert len(wrong) == len(right) == 8
        for name, state in wrong.items():
            assert_bitwise(state["exp_avg"], state["exp_avg_sq"], f"rank {rank} torch {name}")
            assert not torch.equal(right[name]["exp_avg"], right[name]["exp_avg_sq"])
        assert_bitwise(ours["osd offload"], theirs["osd rank0_only=False"], f"rank {rank} ours vs torch's right")
        assert theirs["resumed offload"]["losses"][1] != theirs["continued"]["losses"][1]
        assert_bitwise(ours["resumed offload"], theirs["continued"], f"rank {rank} ours resumed vs continued")


@pytest.mark.parametrize("case", [c for c in THREE if c[0] == "replicas_apart"], ids=_ids)
def test_no_shard_optimizer_state_is_each_rank_s_own_as_torch(request, case):
    per_rank = _per_rank(request, case)
    assert len(per_rank) == 3
    for rank, (ours, theirs) in enumerate(per_rank):
        assert_bitwise(ours["osd"], theirs["osd"], f"rank {rank}")
    firsts = [next(iter(o["osd"]["state"].values()))["exp_avg"] for o, _ in per_rank]
    assert not torch.equal(firsts[0], firsts[2])  # the ranks' own states differ: the test can tell whose is saved


def test_grad_scaler_saved_between_growth_steps_resumes_as_torch(request):
    """growth_interval=3: saved with its growth tracker at 1 and 2, and after a backoff; each
    loaded into a fresh scaler built with other settings, trained to the end: the scale after every step,
    the losses and the parameters are the run that never stopped, on both sides, and ours are torch's."""
    for rank, (ours, theirs) in enumerate(_per_rank(request, ("scaler",))):
        assert_bitwise(ours, theirs, f"rank {rank}")
        for side in (ours, theirs):
            assert [s["_growth_tracker"] for s in side["saved"].values()] == [1, 2, 0]
            whole = side["continued"]
            for step in W.SAVE_AFTER:
                resumed = side[f"resumed after {step}"]
                assert_bitwise(resumed["scales"], whole["scales"][step + 1:], f"rank {rank} scales after {step}")
                assert_bitwise(resumed["losses"], whole["losses"][step + 1:], f"rank {rank} losses after {step}")
                assert_bitwise(resumed["full"], whole["full"], f"rank {rank} parameters after {step}")
    scales = _per_rank(request, ("scaler",))[0][1]["continued"]["scales"]
    assert scales == [256.0, 256.0, 512.0, 256.0, 256.0, 256.0, 512.0]  # x2 after 3 clean steps, x0.5 at the inf
