"""Code written for torch FSDP1's public API runs unchanged on ours, with torch's results.

Oracle: torch FSDP1 (``torch.distributed.fsdp.FullyShardedDataParallel``, ``device_id=cpu``, gloo)
running the very same user code (``tests/_workers_torch_api.py``) on the same seed and data.
Tolerance: bitwise in fp32 (we run torch's operations in its order, see tests/test_fsdp_parity.py);
every comparison (``tests/_workers_fsdp.assert_bitwise``) checks keys, lengths, types, dtypes and shapes
first.  2 ranks, 3 where sizes matter (no world size in {2, 3} divides the test model's flat parameters, so
shards are padded).
"""

import pytest
import torch

from minifsdp import spawn
from tests import _workers_torch_api as W
from tests._workers_fsdp import assert_bitwise


def run(case, *args, world=2):
    results = spawn(W.both, (case, *args), world_size=world)
    assert len(results) == world
    for rank, r in enumerate(results):
        assert_bitwise(r["ours"], r["torch"], f"rank {rank}")
    return results


# ---------------------------------------------------------------- item 1: state_dict_type
@pytest.mark.parametrize("offload,rank0_only", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("orig", [False, True])
def test_full_state_dict_type_as_torch(offload, rank0_only, orig):
    rs = run("full_state_dict", offload, rank0_only, orig, False, world=3)
    assert rs[0]["ours"]["keys"][:2] == ["0.weight", "0.bias"]
    assert (rs[1]["ours"]["keys"] == []) == rank0_only


def test_full_state_dict_under_mixed_precision_keeps_buffer_dtypes():
    rs = run("full_state_dict", False, False, False, True, world=2)
    assert rs[0]["ours"]["values"]["1.running_mean"][0] == torch.float32


@pytest.mark.parametrize("orig", [False, True])
def test_sharded_state_dict_chunks_and_round_trips(orig):
    rs = run("sharded_state_dict", orig, world=3)
    assert_bitwise(rs[0]["ours"]["loaded"], rs[0]["ours"]["saved"], "loaded vs saved")


def test_local_state_dict_is_the_flat_shard_and_round_trips():
    """Keys and local shards as torch's; its values are views of the live flat shards, as torch's and as
    ``nn.Module.state_dict()``'s (a dict kept and loaded after more steps loads what the model holds now);
    a deep copy loaded back restores the parameters, on both."""
    rs = spawn(W.both, ("local_state_dict",), world_size=3)
    assert len(rs) == 3
    for r in rs:
        assert_bitwise({k: r["ours"][k] for k in ("keys", "local", "aliased", "loaded")},
                       {k: r["torch"][k] for k in ("keys", "local", "aliased", "loaded")})
        assert_bitwise(r["ours"]["aliased"], r["ours"]["continued"], "the kept dict's views: the model as it is")
        assert_bitwise(r["ours"]["loaded"], r["ours"]["saved"], "a deep copy loaded back")
        assert not all(torch.equal(a[1], b[1]) for a, b in zip(r["ours"]["loaded"], r["ours"]["continued"]))
    assert rs[0]["ours"]["keys"] == ["_flat_param", "0._flat_param", "2._flat_param"]


@pytest.mark.parametrize("rank0_only", [False, True])
def test_full_optim_state_dict_as_torch(rank0_only):
    rs = run("optim_state_dict", False, rank0_only, world=3)
    assert len(rs[0]["ours"]["state"]) == 6
    if not rank0_only:
        assert_bitwise(rs[0]["ours"]["resumed"], rs[0]["ours"]["continued"], "resumed vs continued")


@pytest.mark.parametrize("rank0_only", [False, True])
def test_full_optim_state_dict_with_orig_params_as_torch(rank0_only):
    """use_orig_params=True, SGD with momentum.  (Not Adam: torch FSDP1 on CPU then returns exp_avg_sq in
    place of exp_avg, both entries equal; and Adam's exp_avg differs in the last bit between
    use_orig_params=True and False (lerp over differently sized tensors), so neither is an oracle.)"""
    rs = run("optim_state_dict", True, rank0_only, "sgd", world=3)
    assert len(rs[0]["ours"]["state"]) == 6
    if not rank0_only:
        assert_bitwise(rs[0]["ours"]["resumed"], rs[0]["ours"]["continued"], "resumed vs continued")


def test_state_dict_settings_as_torch():
    rs = run("settings")
    assert rs[0]["ours"]["wrong"] == "RuntimeError"
    assert rs[0]["ours"]["after"][0] == rs[0]["ours"]["now"][0]


# ---------------------------------------------------------------- items 2, 3
def test_indexing_a_wrapped_sequential():
    rs = run("getitem")
    assert rs[0]["ours"]["types"] == [True, "ReLU"]


@pytest.mark.parametrize("orig", [False, True])
def test_fsdp_modules(orig):
    """The units, the root only, those under a child; each unit's ``_flat_param`` (its local shard; with
    use_orig_params torch fills alignment gaps with 42 and we with 0, so only False compares it)."""
    if orig:
        rs = spawn(W.both, ("fsdp_modules", True), world_size=3)
        assert len(rs) == 3
        for r in rs:
            keys = ("all", "roots", "inner")
            assert_bitwise({k: r["ours"][k] for k in keys}, {k: r["torch"][k] for k in keys})
            assert_bitwise([None if f is None else f.shape for f in r["ours"]["flat"]],
                           [None if f is None else f.shape for f in r["torch"]["flat"]])
        return
    rs = run("fsdp_modules", False, world=3)
    assert rs[0]["ours"]["roots"] == [""]


def test_apply_before_the_first_forward_sees_full_parameters():
    rs = run("apply", world=3)
    assert rs[0]["ours"]["shapes"] == [(13, 5), (11, 13), (3, 11)]


# ---------------------------------------------------------------- item 4
@pytest.mark.parametrize("kind", ["cpu_offload", "strategy_none", "device_id"])
def test_constructor_keywords_as_torch(kind):
    run("constructor", kind, world=3)


def test_parameter_offload_is_refused_as_torch_on_cpu():
    rs = spawn(W.both, ("offload_params",), world_size=2)
    assert len(rs) == 2
    for r in rs:
        assert r["torch"] is not None and r["ours"] == {"type": r["torch"]["type"], "names_fix": True}


# ---------------------------------------------------------------- item 5
@pytest.mark.parametrize("orig", [False, True])
@pytest.mark.parametrize("kind", ["writeback_false", "rank0_only", "offload", "recurse_false", "errors"])
def test_summon_full_params_arguments_as_torch(orig, kind):
    run("summon", orig, kind, world=3)


def test_summon_full_params_with_grads_as_torch():
    rs = run("summon", True, "with_grads", world=3)
    assert all(g is not None for *_, g in rs[0]["ours"]["inside"])


# ---------------------------------------------------------------- item 6
@pytest.mark.parametrize("orig", [False, True])
@pytest.mark.parametrize("strategy", ["FULL_SHARD", "NO_SHARD"])
def test_keep_low_precision_grads_as_torch(orig, strategy):
    rs = run("keep_low_precision_grads", orig, strategy, world=3)
    assert {g[0] for g in rs[0]["ours"]["grads"][0] if g is not None} == {torch.float16}


@pytest.mark.parametrize("orig", [False, True])
@pytest.mark.parametrize("as_states", [False, True])
def test_ignored_modules_stay_whole_and_local_as_torch(orig, as_states):
    rs = run("ignored", orig, as_states, world=3)
    assert rs[0]["ours"]["ignored"].shape == (11, 13)
    assert any(shape == (11, 13) for shape, _ in rs[1]["ours"]["local"])  # not sharded


def test_torch_enums_and_mixed_precision_are_accepted():
    run("torch_enums", world=3)


# ---------------------------------------------------------------- item 7
@pytest.mark.parametrize("orig", [False, True])
def test_no_sync_grads_are_the_accumulated_unsharded_gradients(orig):
    rs = run("no_sync_grads", orig, world=3)
    assert all(g is not None for _, g in rs[0]["ours"]["inside1"])


@pytest.mark.parametrize("norm_type", [2.0, float("inf")])
def test_clip_grad_norm_with_empty_shards_as_torch(norm_type):
    rs = run("clip_inf", norm_type, world=3)
    assert any(g is None for g in rs[0]["ours"]["grads"])  # a parameter rank 0 holds none of: grad None


def test_clip_grad_norm_without_gradients_warns_as_torch():
    rs = run("clip_no_grads")
    assert len(rs[0]["ours"]["warned"]) == 1


# ---------------------------------------------------------------- item 8
@pytest.mark.parametrize("kind", ["summon_in_forward", "summon_in_backward", "mixed_orig_params"])
def test_errors_torch_raises(kind):
    rs = run("errors", kind)
    assert rs[0]["ours"] is not None
