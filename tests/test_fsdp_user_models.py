"""Our FSDP on models and calls this project's own fixtures never made, against torch FSDP1.

Oracle: torch FSDP1 on the same model, seed, data and wrapping (``size_based_auto_wrap_policy``,
``min_num_params=40``), ``device_id=cpu``.  Tolerance: bitwise, unless a test says otherwise (we
run torch's exact operations in its order: see tests/test_fsdp_parity.py).  Sizes: Linear(5, 7),
(5, 13), (13, 11) ... so that no world size in {2, 3} divides the flat parameters (padding).
"""

import pytest

from minifsdp import spawn
from tests import _workers_user_models as W
from tests._workers_fsdp import assert_bitwise


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("orig", [False, True])
def test_batchnorm_model_trains_as_torch(world, orig):
    for r in spawn(W.batchnorm_worker, (orig,), world_size=world):
        ours, theirs = r["ours"], r["torch"]
        assert_bitwise(ours["losses"], theirs["losses"], "losses")
        assert_bitwise(ours["eval"], theirs["eval"], "eval output")
        assert list(ours["buffers"]) == list(theirs["buffers"]) == [
            "1.running_mean", "1.running_var", "1.num_batches_tracked"]
        assert_bitwise(list(ours["buffers"].values()), list(theirs["buffers"].values()), "buffers")
        assert ours["buffers"]["1.num_batches_tracked"].item() == W.STEPS
        assert_bitwise(ours["full"], theirs["full"], "full parameters")
        if not orig:  # each rank's flat shards; with use_orig_params torch fills alignment gaps with 42
            assert_bitwise(ours["shards"], theirs["shards"], "local shards")


@pytest.mark.parametrize("orig", [False, True])
def test_summon_full_params_shows_what_torch_shows(orig):
    for r in spawn(W.summon_worker, (orig,), world_size=3):
        ours, theirs = r["ours"], r["torch"]
        assert [n for n, *_ in ours["full"]] == ["0.weight", "0.bias", "2.weight", "2.bias", "4.weight", "4.bias"]
        assert_bitwise(ours["full"], theirs["full"], "inside summon_full_params")
        assert_bitwise(ours["flat"], theirs["flat"], "parameters()")  # no flat parameter, no padding in parameters()
        assert_bitwise(ours["after"], theirs["after"], "after an edit written back")


@pytest.mark.parametrize("orig", [False, True])
@pytest.mark.parametrize("set_to_none", [True, False])
def test_discarded_no_sync_gradients_do_not_leak(orig, set_to_none):
    for r in spawn(W.no_sync_worker, (orig, set_to_none), world_size=2):
        assert_bitwise(r["ours"]["losses"], r["torch"]["losses"], "losses")
        assert_bitwise(r["ours"]["full"], r["torch"]["full"], "parameters")


@pytest.mark.parametrize("orig", [False, True])
def test_kept_no_sync_gradients_accumulate_as_torch(orig):
    for r in spawn(W.no_sync_worker, (orig, True, False), world_size=2):
        assert_bitwise(r["ours"]["losses"], r["torch"]["losses"], "losses")
        assert_bitwise(r["ours"]["full"], r["torch"]["full"], "parameters")


def test_mixed_dtypes_in_one_unit_are_refused_with_the_reason():
    r = spawn(W.mixed_dtype_worker, world_size=2)[0]
    assert r["torch"] is not None and "uniform dtype" in r["torch"]
    assert r["ours"] is not None and "mixes parameter dtypes" in r["ours"] and "2.weight" in r["ours"]


def test_summon_without_recurse_never_picks_a_child():
    r = spawn(W.recurse_false_worker, world_size=2)[0]
    assert not r["root_has_params"]
    # the children stay sharded: their flat parameters, not full Linear weights
    # (named as torch names them there: the root is in the summon too, so the wrapper prefixes are dropped)
    assert [n for n, _ in r["inside"]] == ["0._flat_param", "1._flat_param"]
