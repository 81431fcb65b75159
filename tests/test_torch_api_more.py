"""torch FSDP1's public API, part 2: torch FSDP1 user code that must behave as on torch (CPU, gloo).

Oracle: torch FSDP1 (``device_id=cpu``, gloo) running the same rank function
(``tests/_workers_torch_api_more.py``) on the same seed and data; bitwise in fp32 unless a test says
why not.  Comparisons check keys, lengths, types, dtypes and shapes first (``tests/_workers_fsdp.assert_bitwise``).
2 ranks (Linear(5, 13)'s weight and bias already straddle the shards there).
"""

import pytest
import torch

from minifsdp import spawn
from tests import _workers_torch_api as W1
from tests import _workers_torch_api_more as W
from tests._workers_fsdp import assert_bitwise


def run(case, *args, world=2):
    results = spawn(W.both, (case, *args), world_size=world)
    assert len(results) == world
    for rank, r in enumerate(results):
        assert_bitwise(r["ours"], r["torch"], f"rank {rank}")
    return results


@pytest.mark.parametrize("norm_type", [2.0, float("inf")])
def test_empty_local_pieces_have_no_grad_and_clip_as_torch_at_two_ranks(norm_type):
    """use_orig_params=True, 2 ranks: every bias lies wholly on rank 1, so rank 0's ``.grad`` is None for it
    (not an empty tensor), and ``clip_grad_norm_`` (inf too) returns torch's norm and clips as torch.
    (tests/test_torch_api.py runs the same case at 3 ranks.)"""
    rs = spawn(W1.both, ("clip_inf", norm_type), world_size=2)
    assert len(rs) == 2
    for rank, r in enumerate(rs):
        assert_bitwise(r["ours"], r["torch"], f"rank {rank}")
    assert [g is None for g in rs[0]["ours"]["grads"]] == [False, True] * 3


@pytest.mark.parametrize("orig", [False, True], ids=["flat", "orig_params"])
def test_clip_returns_the_norm_in_the_gradients_dtype_at_two_ranks(orig):
    """With bf16 gradient shards, ``clip_grad_norm_`` computes in fp32 but returns the norm in the gradients'
    widest dtype (bf16 here), as torch FSDP1; the clipped gradients are bitwise torch's too."""
    rs = spawn(W1.both, ("clip_low_precision_grads", orig), world_size=2)
    assert len(rs) == 2
    for rank, r in enumerate(rs):
        assert_bitwise(r["ours"], r["torch"], f"rank {rank}")
    assert rs[0]["torch"]["total"].dtype == torch.bfloat16


@pytest.mark.parametrize("orig", [False, True], ids=["flat", "orig_params"])
def test_full_state_dict_keeps_ignored_params_and_buffers_as_the_modules_own_at_two_ranks(orig):
    """A FULL state dict clones what FSDP gathered, and hands back the module's own tensors for an ignored
    module's parameters and for buffers, as torch FSDP1 (and ``nn.Module.state_dict``): same keys, same values,
    the same entries aliased."""
    rs = spawn(W1.both, ("state_dict_aliases", orig), world_size=2)
    assert len(rs) == 2
    for rank, r in enumerate(rs):
        assert_bitwise(r["ours"], r["torch"], f"rank {rank}")
    assert rs[0]["torch"]["aliases"]["3.weight"] and not rs[0]["torch"]["aliases"]["0.weight"]


def test_no_sync_shows_the_accumulated_unsharded_grads_at_two_ranks():
    """Inside ``no_sync()`` (use_orig_params=True) each original's ``.grad`` is the accumulated full-shape
    local gradient, as torch shows it; after the synced backward, the reduced local pieces."""
    rs = spawn(W1.both, ("no_sync_grads", True), world_size=2)
    assert len(rs) == 2
    for rank, r in enumerate(rs):
        assert_bitwise(r["ours"], r["torch"], f"rank {rank}")
    assert [tuple(g.shape) for _, g in rs[0]["ours"]["inside1"]][:2] == [(13, 5), (13,)]


def test_freezing_after_wrapping_as_torch():
    """``p.requires_grad_(False)`` after wrapping (use_orig_params=True): grad None, the optimizer leaves
    it, a wholly frozen unit computes none; unfrozen again, it trains (torch FSDP1's behaviour)."""
    rs = run("freeze_after_wrap")
    grads = dict(rs[0]["ours"]["grads"][0])
    assert grads["_fsdp_wrapped_module.2._fsdp_wrapped_module.weight"] is None
    assert grads["_fsdp_wrapped_module.4.weight"] is None
    assert dict(rs[0]["ours"]["grads"][2])["_fsdp_wrapped_module.2._fsdp_wrapped_module.weight"] is not None
    assert isinstance(rs[0]["ours"]["full"][0][1], torch.Tensor)


@pytest.mark.parametrize("orig", [False, True])
@pytest.mark.parametrize("how", ["half", "to_float16", "double"])
def test_dtype_conversion_before_the_first_forward_trains_as_torch(orig, how):
    """``model.half()`` (``.to(torch.float16)``, ``.double()``) after wrapping, before the first forward:
    the flat parameters are converted and the step runs in that dtype, bitwise torch's."""
    rs = run("convert", orig, how, True)
    want = torch.float64 if how == "double" else torch.float16
    assert {d for _, d, _ in rs[0]["ours"]["params"]} == {want}
    assert rs[0]["ours"]["losses"][0].dtype == want


@pytest.mark.parametrize("orig", [False, True])
def test_dtype_conversion_after_the_first_forward_raises_as_torch(orig):
    """After the first forward torch FSDP1 refuses at the all-gather (ValueError, its gather buffer keeps
    the old dtype); ours raises the same type, naming the fix."""
    rs = spawn(W.both, ("convert", orig, "half", False), world_size=2)
    assert len(rs) == 2
    for r in rs:
        assert_bitwise(r["ours"]["params"], r["torch"]["params"])
        assert r["torch"]["error"] == r["ours"]["error"] == "ValueError"
        assert r["ours"]["names_fix"]


def test_sharded_grad_scaler_has_torch_public_api():
    """Every public name of torch's ShardedGradScaler (introspected) exists on ours."""
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler as TorchScaler

    from minifsdp import ShardedGradScaler

    theirs = {n for n in dir(TorchScaler) if not n.startswith("_")}
    assert {"get_backoff_factor", "set_growth_interval", "state_dict", "unscale_"} <= theirs
    assert theirs - set(dir(ShardedGradScaler)) == set()


@pytest.mark.parametrize("orig", [False, True])
def test_sharded_grad_scaler_as_torch(orig):
    """torch's ShardedGradScaler(device="cpu") is the oracle: the scale after each step (backoff and
    growth, changed factors), which steps are skipped, the fp16 gradients, errors, state dicts, bitwise."""
    rs = run("scaler", orig)
    o = rs[0]["ours"]
    assert o["stepped"] == [[True, True], [False, True]] + [[True, True]] * 4  # the inf: opts[0]'s gradients
    assert o["scales"] == [1024.0, 512.0, 512.0, 1024.0, 4096.0, 16384.0]
    assert o["twice"][0] == o["step_twice"][0] == "RuntimeError"


def test_names_with_orig_params_as_torch():
    """use_orig_params=True: the names (and shapes) ``named_parameters()`` yields outside, inside a
    forward and inside ``summon_full_params`` are torch FSDP1's."""
    rs = run("names")
    o = rs[0]["ours"]
    assert [n for n, *_ in o["summon"]] == ["0.weight", "0.bias", "2.weight", "2.bias", "4.weight", "4.bias"]
    assert ("weight", (11, 13), False) in o["forward_inner"]  # the running unit's: full shape, a plain tensor
    assert o["after"] == o["outside"]


@pytest.mark.parametrize("with_step", [False, True])
def test_nonuniform_req_grad_model_state_dict_as_torch(with_step):
    """torch's ``NonUniformReqGradNWM`` (frozen and trainable parameters in one unit, use_orig_params, fp16
    parameters), a forward and backward, then ``state_dict()``: no crash, and the loss, the gradients (None
    where a rank holds none of a parameter) and the full state dict are torch's."""
    rs = run("nonuniform_req_grad", with_step)
    assert all(g is None for _, g in rs[0]["ours"]["grads"])  # rank 0 holds none of module.2.1
    assert any(g is not None for _, g in rs[1]["ours"]["grads"])
    assert list(rs[0]["ours"]["state_dict"])[0] == "module.0.weight"


PLAIN_ROOT = [("FULL_STATE_DICT", False), ("FULL_STATE_DICT", True), ("SHARDED_STATE_DICT", False),
              ("SHARDED_STATE_DICT", True), ("LOCAL_STATE_DICT", False)]


def _without_value_kinds(result: dict) -> dict:
    """The case's result without ``whole_values`` (the keys whose value is a plain tensor): at 2 ranks SHARDED and
    LOCAL values are sharded on both sides, but of different classes (DTensor / plain shard vs ShardedTensor:
    the module docstring of minifsdp/fsdp/state_dict_type.py says why)."""
    return {k: v for k, v in result.items() if k != "whole_values"}


@pytest.mark.parametrize(("kind", "orig"), PLAIN_ROOT)
def test_state_dict_through_a_plain_root_loads_as_torch(kind, orig):
    """A plain ``nn.Module`` root with FSDP children: ``load_state_dict`` of what ``state_dict()`` gave restores
    the trained model (the resumed run's losses are the uninterrupted run's, bitwise, as torch's), and the
    strict checks raise as torch's for an extra and a missing key.  (LOCAL with ``use_orig_params=True`` is left
    out: torch FSDP1 itself fails to load it here, "Unexpected key(s) ... body._flat_param".)"""
    rs = spawn(W.both, ("plain_root_state_dict", kind, orig), world_size=2)
    assert len(rs) == 2
    for rank, r in enumerate(rs):
        assert_bitwise(_without_value_kinds(r["ours"]), _without_value_kinds(r["torch"]), f"rank {rank}")
        assert r["ours"]["result"] == ([], []) and r["ours"]["extra"] == r["ours"]["missing"] == "RuntimeError"
        assert r["ours"]["missing_lax"] == ["plain.bias"]
        assert r["ours"]["resumed_losses"] == r["ours"]["more_losses"]


@pytest.mark.parametrize(("strategy", "how", "world"), [(s, h, 2) for s in ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD")
                                                     for h in ("data", "param", "grad")]
                         + [("FULL_SHARD", "data", 3), ("FULL_SHARD", "param", 3)])
def test_use_orig_params_writes_back_what_the_user_changed_as_torch(strategy, how, world):
    """use_orig_params=True: a weight given new storage, a new Parameter under its name, or new gradients
    between steps are written back into the flat shard before the next all-gather, as torch FSDP1's
    ``_writeback_orig_params``: the losses after it, the full parameters, and every name's shape after a forward
    (SHARD_GRAD_OP keeps full shapes until the backward) are bitwise torch's."""
    rs = run("writeback", strategy, how, world=world)
    ours = rs[0]["ours"]
    assert len(ours["losses"]) == 3 and len(ours["full"]) == 6
    full_shapes = strategy != "FULL_SHARD"  # the forward's views kept (SHARD_GRAD_OP); NO_SHARD's are whole
    assert all((len(shape) == 2) == (full_shapes and name.endswith("weight"))
               for name, shape in ours["shapes_after_forward"])


@pytest.mark.parametrize("how", ["shape", "between"])
def test_use_orig_params_refuses_a_write_back_as_torch(how):
    """A piece of another shape raises RuntimeError at the next forward; changing a parameter between forward
    and backward under SHARD_GRAD_OP raises AssertionError at the backward: torch FSDP1's errors, on both ranks."""
    rs = run("writeback_errors", how)
    assert [r["ours"] for r in rs] == [{"shape": "RuntimeError", "between": "AssertionError"}[how]] * 2


TWO_OPTIMIZERS = ["FULL_SHARD", "NO_SHARD"]


@pytest.mark.parametrize("strategy", TWO_OPTIMIZERS)
def test_two_optimizers_over_one_model_as_torch(strategy):
    """use_orig_params=True, two optimizers over disjoint parameters, one zeroing to None and one to zeros:
    losses, every gradient and the full parameters after 3 steps bitwise torch FSDP1's."""
    rs = run("two_optimizers", strategy)
    assert len(rs[0]["ours"]["losses"]) == 3 and len(rs[0]["ours"]["grads"][0]) == 6


@pytest.mark.parametrize(("strategy", "writeback"), [("FULL_SHARD", True), ("FULL_SHARD", False),
                                                     ("NO_SHARD", True)])
def test_summon_with_grads_edits_as_torch(strategy, writeback):
    """Gradients edited inside ``summon_full_params(with_grads=True)``: written back into the shards' gradients
    with ``writeback=True``, dropped without; kept under NO_SHARD (the gradients are the flat gradient's views);
    the gradients after and the parameters after a step bitwise torch FSDP1's."""
    rs = run("summon_with_grads_edit", strategy, writeback)
    assert len(rs[0]["ours"]["inside"]) == len(rs[0]["ours"]["after"]) == 6


# ---------------------------------------------------------------- the same cases at 1 and 3 ranks
AT_ANY_WORLD = ([("plain_root_state_dict", k, o) for k, o in PLAIN_ROOT]
                + [("two_optimizers", s) for s in TWO_OPTIMIZERS]
                + [("offload_refused_after_torch_s_wrap_errors", manual) for manual in (False, True)])
_AT_WORLD: dict = {}


def _at_world(world: int) -> list:
    """Every case of AT_ANY_WORLD at ``world`` ranks, in one spawn (start-up costs more than the cases)."""
    if world not in _AT_WORLD:
        _AT_WORLD[world] = spawn(W.many, (AT_ANY_WORLD,), world_size=world, timeout_s=240)
    return _AT_WORLD[world]


@pytest.mark.parametrize("world", [1, 3])
@pytest.mark.parametrize("case", AT_ANY_WORLD, ids=lambda c: "-".join(map(str, c)))
def test_plain_root_and_two_optimizers_as_torch_at_one_and_three_ranks(case, world):
    """The plain-root state-dict cases and the two-optimizer cases above, and a wrap with parameter offload that
    torch refuses for another reason first (ours raises torch's error; also where a unit wrapped by hand
    before it holds the offload), at 1 rank (FULL_SHARD becomes NO_SHARD)
    and at 3 (Linear(5, 13) and Linear(13, 11) straddle shards no size divides).  Oracle: torch FSDP1 on the same
    ranks; bitwise.  At 1 rank each state-dict value that torch gives as a whole tensor is one in ours too."""
    results = _at_world(world)
    assert len(results) == world
    i = AT_ANY_WORLD.index(case)
    for rank, per_case in enumerate(results):
        r = per_case[i]
        assert "error" not in r, f"rank {rank}: {r['error']}"
        if case[0] == "plain_root_state_dict":
            if world == 1:
                assert r["ours"]["whole_values"] == r["torch"]["whole_values"], "values torch gives whole"
            assert_bitwise(_without_value_kinds(r["ours"]), _without_value_kinds(r["torch"]), f"rank {rank}")
            assert r["ours"]["result"] == ([], []) and r["ours"]["missing_lax"] == ["plain.bias"]
            assert r["ours"]["resumed_losses"] == r["ours"]["more_losses"]
        elif case[0] == "offload_refused_after_torch_s_wrap_errors":  # torch's wrap-time error comes first
            assert r["ours"] == r["torch"] == {"wrap": "ValueError"}, f"rank {rank}"
        else:
            assert_bitwise(r["ours"], r["torch"], f"rank {rank}")
            assert len(r["ours"]["losses"]) == 3 and len(r["ours"]["grads"][0]) == 6
