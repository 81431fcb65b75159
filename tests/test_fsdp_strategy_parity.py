"""Sharding strategies and regimes against torch, each case torch user code run on torch and on ours in one spawn.

Oracle: torch 2.13's ``FullyShardedDataParallel`` and ``fully_shard``, run in the same 4-rank spawn on the same
models, seeds and data (``tests/_workers_strategy_parity.py``, whose table lists the cases).  Exact: every number
bitwise (``assert_bitwise``: dtype, shape, bits), every collective by kind and size as recorded from the c10d ops
each side issued, errors by type and torch's message.

1. NO_SHARD + use_orig_params: the flat parameter padded to the group's size, as torch's (fp32 and bf16).
2. HYBRID_SHARD and _HYBRID_SHARD_ZERO2 given no groups (torch builds them per node), on a 2-D device_mesh, and
   without a wrap policy (torch's error).
3. Regimes: ``clip_grad_norm_`` below ``max_norm``; ``fully_shard`` on a (2, 2) mesh in bf16 and fp16.
4. Where torch 2.13 is wrong, both behaviours are pinned: torch's result asserted as torch's (a torch that fixes
   it fails the test, and the chapter's table is updated), ours asserted right against a torch run that is.
"""

import pytest
import torch

from minifsdp import spawn
from tests import _workers_strategy_parity as W
from tests._selection import module_name
from tests._workers_fsdp import assert_bitwise

WORLD = 4
_CASE_OF = {"test_no_shard_use_orig_params_pads_the_flat_parameter_as_torch": "flat_sizes",
            "test_hybrid_shard_without_groups_builds_torch_s_groups": "hybrid",
            "test_hybrid_shard_without_groups_on_the_cpu_keeps_the_replicas_in_step": "hybrid",
            "test_hybrid_shard_manual_wrap_without_groups_raises_torch_s_error": "hybrid",
            "test_hybrid_shard_on_a_2d_device_mesh_trains_as_torch": "hybrid",
            "test_clip_grad_norm_below_max_norm_leaves_the_gradients_bitwise": "clip_below",
            "test_fully_shard_hsdp_mixed_precision_as_torch": "hsdp_mp",
            "test_dropped_forward_under_param_dtype_leaves_the_next_gradient": "dropped_forward",
            "test_tied_weight_under_no_sync_with_no_shard_orig_params_bf16_trains": "tied_no_sync"}


@pytest.fixture(scope="module")
def ranks(request):
    """Every case this session selected, in one 4-rank spawn (a test run alone runs its case only)."""
    names = {_CASE_OF[item.originalname] for item in request.session.items
             if module_name(item) == __name__ and getattr(item, "originalname", None) in _CASE_OF}
    results = spawn(W.all_cases, (tuple(n for n in W.CASES if n in names),), world_size=WORLD, timeout_s=600)
    assert len(results) == WORLD
    for rank, r in enumerate(results):
        for name in names:
            assert "case_error" not in r[name], f"rank {rank}, case {name}:\n{r[name].get('case_error')}"
    return results


def _no_error(res: dict, what: str) -> dict:
    assert "error" not in res, f"{what}: {res.get('error')}\n{res.get('trace', '')}"
    return res


def _same_training(ours: dict, theirs: dict, what: str, collectives: bool = True) -> None:
    """Losses, every step's gradients (and the backward's collectives), the full parameters after: bitwise."""
    assert len(ours["losses"]) == len(theirs["losses"]) > 0, what
    keys = ("losses", "grads", "full") + (("collectives",) if collectives else ())
    for key in keys:
        assert_bitwise(ours[key], theirs[key], f"{what} {key}")


# ---------------------------------------------------------------------- 1. NO_SHARD + use_orig_params: padding
@pytest.mark.parametrize("dtype", list(W.FLAT_DTYPES))
@pytest.mark.parametrize("k", W.FLAT_GROUP_SIZES)
def test_no_shard_use_orig_params_pads_the_flat_parameter_as_torch(ranks, k, dtype):
    """torch (``_flat_param.py``, ``_init_flat_param_and_metadata``) aligns each original to 16 bytes and pads
    the flat parameter to a multiple of the group's size when use_orig_params=True, NO_SHARD too, so NO_SHARD
    all-reduces the padded size; under a bf16 param_dtype the alignment is 8 numbers and the all-reduce is the
    padded low-precision flat parameter.  Each unit's numel and each all-reduce's size are torch's."""
    for rank in range(k):
        what = f"rank {rank}, group of {k}, {dtype}"
        res = ranks[rank]["flat_sizes"][(k, dtype)]
        ours, theirs = _no_error(res["ours"], f"{what} ours"), _no_error(res["torch"], f"{what} torch")
        assert ours["numels"] == theirs["numels"], what
        assert all(n % k == 0 for n in theirs["numels"]), f"{what}: torch's sizes {theirs['numels']}"
        _same_training(ours, theirs, what)


# ---------------------------------------------------------------------- 2. HYBRID_SHARD given no groups
@pytest.mark.parametrize("strategy", W.HYBRID)
def test_hybrid_shard_without_groups_builds_torch_s_groups(ranks, strategy):
    """torch builds a shard group per node (``_init_utils.py``: ``_init_process_group_state_for_hybrid_shard``,
    ``_init_intra_and_inter_node_groups``), a node being ``_device_handle.device_count()`` ranks: on the CPU
    ``torch.cpu.device_count()`` is 1, so each rank shards alone and the replicate group is the world.  Ours
    builds the same groups for every unit.  torch then clamps the strategy to NO_SHARD (its shard group has 1
    rank) and warns; ours keeps the strategy and warns what it does (``pitfalls.warn_hybrid_shard_of_one``)."""
    for rank, r in enumerate(ranks):
        res = r["hybrid"][strategy]
        ours, theirs = _no_error(res["ours"], f"rank {rank} ours"), _no_error(res["torch"], f"rank {rank} torch")
        assert len(ours["groups"]) == len(theirs["groups"]) > 1
        assert [g[1:] for g in ours["groups"]] == [g[1:] for g in theirs["groups"]], f"rank {rank}"
        assert theirs["groups"][0][1:] == ([rank], list(range(WORLD)))  # torch's, recorded: a node per rank
        assert {g[0] for g in theirs["groups"]} == {"NO_SHARD"} and {g[0] for g in ours["groups"]} == {strategy}
        assert any("switching to use `NO_SHARD`" in w for w in theirs["warnings"]), theirs["warnings"]
        assert len(ours["warnings"]) == 1 and "shard group of 1 rank shards nothing" in ours["warnings"][0]


@pytest.mark.parametrize("strategy", W.HYBRID)
def test_hybrid_shard_without_groups_on_the_cpu_keeps_the_replicas_in_step(ranks, strategy):
    """torch is wrong here: having clamped the strategy to NO_SHARD, it all-reduces each gradient over the 1-rank
    shard group (``_runtime_utils.py``, ``_reduce_grad_no_shard``), divided by the whole world's factors
    (predivide 2, postdivide 2 at 4 ranks): each replica steps on a quarter of its own gradient and they drift
    apart.  Pinned as torch's: its replicas differ after 2 steps.  Ours all-reduces over the replicate group:
    bitwise torch's NO_SHARD over all 4 ranks, every step."""
    for rank, r in enumerate(ranks):
        res = r["hybrid"][strategy]
        assert not res["torch"]["replicas_equal"], f"rank {rank}: torch's replicas stayed equal (fixed in torch?)"
        assert res["ours"]["replicas_equal"], f"rank {rank}"
        _same_training(res["ours"], res["torch_no_shard"], f"rank {rank} ours vs torch's NO_SHARD",
                       collectives=False)


@pytest.mark.parametrize("strategy", W.HYBRID)
def test_hybrid_shard_manual_wrap_without_groups_raises_torch_s_error(ranks, strategy):
    """No auto_wrap_policy, no groups, no mesh: each FSDP(...) would build groups of its own, so torch refuses
    (``_init_process_group_state``); ours raises the same type with torch's words first, then the fix."""
    for rank, r in enumerate(ranks):
        ours, theirs = r["hybrid"][strategy]["ours"]["manual_wrap"], r["hybrid"][strategy]["torch"]["manual_wrap"]
        assert theirs is not None and ours is not None, f"rank {rank}: torch {theirs}, ours {ours}"
        assert ours[0] == theirs[0] == "ValueError"
        assert ours[1].startswith(theirs[1].rstrip(".")), (ours[1], theirs[1])
        assert "device_mesh=init_device_mesh" in ours[1] and "(shard_group, replicate_group)" in ours[1]


@pytest.mark.parametrize("strategy", W.HYBRID)
def test_hybrid_shard_on_a_2d_device_mesh_trains_as_torch(ranks, strategy):
    """``device_mesh=init_device_mesh("cpu", (2, 2))`` with an auto_wrap_policy: torch shards over dim 1 and
    all-reduces over dim 0; so do ours, every unit, the same collectives in the same order, bitwise."""
    for rank, r in enumerate(ranks):
        ours, theirs = r["hybrid"][strategy]["ours"]["mesh"], r["hybrid"][strategy]["torch"]["mesh"]
        assert ours["groups"] == theirs["groups"], f"rank {rank}"
        assert {g[0] for g in theirs["groups"]} == {strategy}
        _same_training(ours, theirs, f"rank {rank}")


# ---------------------------------------------------------------------- 3. regimes no other test holds
@pytest.mark.parametrize("case", list(W.CLIP_CASES))
def test_clip_grad_norm_below_max_norm_leaves_the_gradients_bitwise(ranks, case):
    """Total norm far below ``max_norm``: torch multiplies every gradient by ``clamp(max_norm / (total + 1e-6),
    max=1.0)``, exactly 1.0 (``fully_sharded_data_parallel.py``, ``clip_grad_norm_``; NO_SHARD through
    ``torch.nn.utils.clip_grad_norm_``), so its gradients keep their bits: recorded, as is how many
    multiplications it ran.  Ours: the same norm, the same multiplications, the same bits."""
    for rank, r in enumerate(ranks):
        ours, theirs = r["clip_below"][case]["ours"], r["clip_below"][case]["torch"]
        what = f"rank {rank} {case}"
        assert_bitwise(theirs["after"], theirs["before"], f"{what}: torch's own gradients (the oracle)")
        assert theirs["multiplies"] > 0, what  # torch does multiply, by 1.0
        assert_bitwise(ours["norm"], theirs["norm"], f"{what} norm")
        assert ours["norm"].item() < W.MAX_NORM
        assert_bitwise(ours["after"], theirs["after"], f"{what} gradients after the clip")
        assert ours["multiplies"] == theirs["multiplies"], what


@pytest.mark.parametrize("dtype", list(W.HSDP_DTYPES))
def test_fully_shard_hsdp_mixed_precision_as_torch(ranks, dtype):
    """``fully_shard`` on a (replicate 2, shard 2) mesh with ``MixedPrecisionPolicy(param_dtype=reduce_dtype=
    bf16 / fp16)``: every local gradient and every local shard after each of 3 AdamW steps, bitwise torch's."""
    for rank, r in enumerate(ranks):
        ours, theirs = r["hsdp_mp"][dtype]["ours"], r["hsdp_mp"][dtype]["torch"]
        assert len(ours["grads"]) == len(theirs["grads"]) == W.HSDP_STEPS
        assert_bitwise(ours, theirs, f"rank {rank} {dtype}")


# ---------------------------------------------------------------------- 4. torch is wrong, ours right
@pytest.mark.parametrize("case", list(W.DROPPED_CASES))
def test_dropped_forward_under_param_dtype_leaves_the_next_gradient(ranks, case):
    """A forward with autograd on whose output is never backpropagated, under ``MixedPrecision(param_dtype=
    bf16)``.  torch is wrong here: each unit registers its post-backward hook once, on the ``AccumulateGrad`` of
    the flat parameter's low-precision copy of the *first* forward that needs one, and forgets it only after a
    backward (``_runtime_utils.py``, ``_register_post_backward_hook``: ``already_registered``); the dropped
    forward's copy dies with its graph, so the next backward runs no post-backward hook at all.  Pinned as
    torch's: that backward issues no reduce-scatter or all-reduce and leaves each unit's gradient whole and in
    bf16.  Ours: the next gradient is bitwise the one without the dropped forward, which is torch's without it."""
    for rank, r in enumerate(ranks):
        res, what = r["dropped_forward"][case], f"rank {rank} {case}"
        plain, dropped = res[("torch", False)], res[("torch", True)]
        assert any(kind != "all-gather" for kind, _ in plain["collectives"]), what
        assert [kind for kind, _ in dropped["collectives"] if kind != "all-gather"] == [], f"{what}: torch reduced"
        assert {g.dtype for _, g in dropped["grads"]} == {torch.bfloat16}, what
        assert_bitwise(res[("ours", False)], plain, f"{what}: ours vs torch, no dropped forward")
        assert_bitwise(res[("ours", True)], res[("ours", False)], f"{what}: ours with vs without the dropped one")


def test_tied_weight_under_no_sync_with_no_shard_orig_params_bf16_trains(ranks):
    """NO_SHARD + use_orig_params + ``MixedPrecision(param_dtype=bf16)``, an embedding and a head sharing their
    weight, a micro-batch under ``no_sync()``.  torch is wrong here: the no_sync gradient is bf16, and
    ``FlatParamHandle._use_sharded_grad_views`` (``_flat_param.py``) gives the original the bf16 gradient through
    a ``.data`` swap but the tied name's ``param.grad = prim_param.grad`` without it, which autograd refuses
    (RuntimeError: a bf16 gradient for a float32 tensor) in the next forward.  Pinned as torch's.  Ours trains,
    bitwise torch's own run with use_orig_params=False (2 ranks, 2 steps)."""
    for rank in (0, 1):
        res = ranks[rank]["tied_no_sync"]
        kind, message = res[("torch", True)]["error"]
        assert kind == "RuntimeError" and "attempting to assign a gradient with dtype" in message, message
        theirs = _no_error(res[("torch", False)], f"rank {rank} torch, use_orig_params=False")
        for orig in (True, False):
            ours = _no_error(res[("ours", orig)], f"rank {rank} ours, use_orig_params={orig}")
            assert_bitwise(ours, theirs, f"rank {rank} ours (use_orig_params={orig}) vs torch (False)")
