"""Our FSDP on models and calls this project's own fixtures never made, against torch FSDP1 (issue 9).

Oracle: torch FSDP1 on the same model, seed, data and wrapping (``size_based_auto_wrap_policy``,
``min_num_params=40``), ``device_id=cpu``.  Tolerance: bitwise, unless a test says otherwise (we
run torch's exact operations in its order: see tests/test_fsdp_parity.py).  Sizes: Linear(5, 7),
(5, 13), (13, 11) ... so that no world size in {2, 3} divides the flat parameters (padding).
"""

import pytest
import torch

from minifsdp import spawn
from tests import _workers_user_models as W


def _same(a, b, what):
    assert len(a) == len(b), f"{what}: {len(a)} vs {len(b)} entries"
    for i, (x, y) in enumerate(zip(a, b)):
        if isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y), f"{what}[{i}] differs"
        else:
            assert x == y, f"{what}[{i}]: {x} vs {y}"


def _same_full(ours, theirs, what):
    """[(name, shape, tensor)] from inside summon_full_params: names, shapes and values equal."""
    assert [(n, s) for n, s, _ in ours] == [(n, s) for n, s, _ in theirs], what
    _same([t for *_, t in ours], [t for *_, t in theirs], what)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("orig", [False, True])
def test_batchnorm_model_trains_as_torch(world, orig):
    for r in spawn(W.batchnorm_worker, (orig,), world_size=world):
        ours, theirs = r["ours"], r["torch"]
        _same(ours["losses"], theirs["losses"], "losses")
        assert torch.equal(ours["eval"], theirs["eval"])
        assert list(ours["buffers"]) == list(theirs["buffers"]) == [
            "1.running_mean", "1.running_var", "1.num_batches_tracked"]
        _same(list(ours["buffers"].values()), list(theirs["buffers"].values()), "buffers")
        assert ours["buffers"]["1.num_batches_tracked"].item() == W.STEPS
        _same_full(ours["full"], theirs["full"], "full parameters")
        if not orig:  # each rank's flat shards; with use_orig_params torch fills alignment gaps with 42
            _same(ours["shards"], theirs["shards"], "local shards")


@pytest.mark.parametrize("orig", [False, True])
def test_summon_full_params_shows_what_torch_shows(orig):
    for r in spawn(W.summon_worker, (orig,), world_size=3):
        ours, theirs = r["ours"], r["torch"]
        assert [n for n, *_ in ours["full"]] == ["0.weight", "0.bias", "2.weight", "2.bias", "4.weight", "4.bias"]
        _same_full(ours["full"], theirs["full"], "inside summon_full_params")
        assert torch.equal(ours["flat"], theirs["flat"])  # no flat parameter, no padding in parameters()
        _same_full(ours["after"], theirs["after"], "after an edit written back")


@pytest.mark.parametrize("orig", [False, True])
@pytest.mark.parametrize("set_to_none", [True, False])
def test_discarded_no_sync_gradients_do_not_leak(orig, set_to_none):
    for r in spawn(W.no_sync_worker, (orig, set_to_none), world_size=2):
        _same(r["ours"]["losses"], r["torch"]["losses"], "losses")
        _same_full(r["ours"]["full"], r["torch"]["full"], "parameters")


@pytest.mark.parametrize("orig", [False, True])
def test_kept_no_sync_gradients_accumulate_as_torch(orig):
    for r in spawn(W.no_sync_worker, (orig, True, False), world_size=2):
        _same(r["ours"]["losses"], r["torch"]["losses"], "losses")
        _same_full(r["ours"]["full"], r["torch"]["full"], "parameters")


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
