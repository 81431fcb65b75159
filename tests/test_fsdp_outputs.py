"""What a forward returns and what the backward keeps track of, against torch FSDP1 (and FSDP2 for the outputs).

1. A unit and the root return a dataclass, a dict or OrderedDict subclass, a namedtuple, a set, a nest of them:
   every tensor that needs a gradient gets its pre-backward hook (torch FSDP1's walk, ``_apply_to_tensors``;
   FSDP2's, ``collect_grad_tensors``), so the backward gathers the parameters again and ends in the final callback.
2. The final callback: torch queues it from the root's pre-backward only, ours from the first (normally the
   root's); where they part, torch is wrong and the tests pin both (a loss on an inner output kept aside; an
   output torch does not walk; the step after a backward that raised).
3. A unit called twice in one forward is in the backward's prefetch order twice, as torch's: the all-gathers and
   reduce-scatters of each step come in torch's order (BACKWARD_PRE and BACKWARD_POST, 2 and 3 ranks).
4. Under ``MixedPrecision(param_dtype=torch.bfloat16)`` each call of a unit adds its gradient alone, as torch's
   flat parameter does: gradients accumulated over backwards (plain NO_SHARD, ``no_sync`` for each strategy) are
   torch's bits; a forward whose output gets no backward leaves torch's gradients unreduced (pinned).
5. A dataclass input under MixedPrecision is cast as torch casts it (the root, a module class kept in fp32).

Oracle: torch FSDP1 / FSDP2 in the same spawn, same seeds and data (``tests/_workers_outputs.py``); where torch is
wrong, torch's own result on the equivalent program it gets right.  Bitwise: losses, every gradient after each
backward, the full parameters after the steps, the collectives' order (c10d ops, each named by its numel).
"""

import pytest
import torch

from minifsdp import spawn
from tests import _workers_outputs as W
from tests._selection import module_name
from tests._workers_fsdp import assert_bitwise

_CASES_OF = {  # test -> the cases it reads, from its parameters
    "test_nested_outputs_train_as_torch_fsdp1": lambda p: [("outputs", p["kind"])],
    "test_a_dict_subclass_comes_back_a_plain_dict_from_torch_fsdp1": lambda p: [("outputs", "dict_subclass")],
    "test_nested_outputs_train_as_torch_fsdp2": lambda p: [("outputs_fsdp2", p["kind"])],
    "test_a_loss_on_an_inner_output_kept_aside_ends_its_backward": lambda p: [("callback", "aside"),
                                                                              ("callback", "through")],
    "test_an_output_torch_does_not_walk_still_ends_its_backward": lambda p: [("callback", "box"),
                                                                             ("callback", "walked")],
    "test_the_step_after_a_backward_that_raised_is_whole": lambda p: [("died", False), ("died", True)],
    "test_a_unit_called_twice_gathers_in_torch_s_order": lambda p: [("twice_order", p["shape"], p["prefetch"])],
    "test_a_unit_called_twice_accumulates_torch_s_bf16_gradients": lambda p: [("mp_twice", *p["case"])],
    "test_a_forward_without_backward_under_bf16_leaves_torch_s_gradients_unreduced":
        lambda p: [("mp_discard", False), ("mp_discard", True)],
    "test_dataclass_inputs_are_cast_as_torch_casts_them": lambda p: [("mp_inputs",)],
}


@pytest.fixture(scope="module")
def runs(request):
    """{world size: {case: {side: result}}} for the cases this session selected, one spawn per world size."""
    wanted = set()
    for item in request.session.items:
        read = _CASES_OF.get(getattr(item, "originalname", None))
        if read is not None and module_name(item) == __name__:
            params = getattr(getattr(item, "callspec", None), "params", {})
            wanted |= {(params.get("world", 2), case) for case in read(params)}
    out = {}
    for world in (2, 3):
        only = tuple(case for w, case in wanted if w == world)
        if only:
            results = spawn(W.all_cases, (only,), world_size=world, timeout_s=600)
            assert len(results) == world
            out[world] = results
    return out


def _sides(runs, case, world: int = 2) -> list[tuple[dict, dict]]:
    """(ours, torch's) on each rank; a side that raised fails here with its traceback."""
    pairs = []
    for rank, per_rank in enumerate(runs[world]):
        res = per_rank[case]
        for side in W.SIDES:
            assert "error" not in res[side], f"rank {rank} {case} {side}:\n{res[side]['error']}"
        pairs.append((res["ours"], res["torch"]))
    assert len(pairs) == world
    return pairs


def _same_training(ours: dict, theirs: dict, what: str, keys=("losses", "grads", "full")) -> None:
    for key in keys:
        assert len(theirs[key]) > 0, f"{what}: torch recorded no {key}"
        assert_bitwise(ours[key], theirs[key], f"{what}: {key}")


# ---------------------------------------------------------------------- 1. nested outputs
@pytest.mark.parametrize("kind", W.KINDS)
def test_nested_outputs_train_as_torch_fsdp1(runs, kind):
    for rank, (ours, theirs) in enumerate(_sides(runs, ("outputs", kind))):
        _same_training(ours, theirs, f"rank {rank}", ("losses", "grads", "full", "forward", "backward"))
        if kind != "dict_subclass":  # (pinned below)
            assert_bitwise(ours["types"], theirs["types"], f"rank {rank}: the nests' types")


def test_a_dict_subclass_comes_back_a_plain_dict_from_torch_fsdp1(runs):
    """torch FSDP1 returns the nest its walk rebuilt (``_runtime_utils._register_pre_backward_hooks`` returns
    ``_apply_to_tensors``' result, which makes any dict but an OrderedDict a plain dict), and only while grad is
    enabled; ours returns the module's own output.  Pinned: what the root saw from the unit, what the user got."""
    for ours, theirs in _sides(runs, ("outputs", "dict_subclass")):
        assert theirs["types"] == [("dict", "dict")] * 2
        assert ours["types"] == [("Out", "Out")] * 2


@pytest.mark.parametrize("kind", W.FSDP2_KINDS)
def test_nested_outputs_train_as_torch_fsdp2(runs, kind):
    for rank, (ours, theirs) in enumerate(_sides(runs, ("outputs_fsdp2", kind))):
        _same_training(ours, theirs, f"rank {rank}", ("losses", "grads", "full", "forward", "backward", "types"))


# ---------------------------------------------------------------------- 2. the final callback
def test_a_loss_on_an_inner_output_kept_aside_ends_its_backward(runs):
    """The root returns a tensor that needs no gradient; the loss is on the body's output, kept aside.  torch gets
    no root pre-backward, so no final callback (``_runtime_utils._pre_backward_hook``: ``if state._is_root and not
    state._post_backward_callback_queued``): its body stays FORWARD_BACKWARD, its reduced shard stays out of
    ``.grad`` (None), ``summon_full_params`` raises.  Ours trains as torch does when the same output is returned."""
    aside, through = _sides(runs, ("callback", "aside")), _sides(runs, ("callback", "through"))
    for rank, ((ours, theirs), (_, reference)) in enumerate(zip(aside, through, strict=True)):
        assert theirs["raised"] == [None, None] and "FORWARD_BACKWARD" in theirs["states"][0], theirs["states"]
        assert [g is None for _, g in theirs["grads"][0]] == [True, True], "torch: neither shard got its gradient"
        assert theirs["summon_raised"] == "AssertionError"
        assert ours["states"] == [["IDLE", "IDLE"]] * 2 and ours["summon_raised"] is None
        _same_training(ours, reference, f"rank {rank}: ours aside, torch through the root")


def test_an_output_torch_does_not_walk_still_ends_its_backward(runs):
    """The root returns its output inside a plain object: torch's root gets no pre-backward, and its post-backward
    hook finds the root IDLE and raises (``_assert_in_training_states``: ValueError).  Ours trains as torch does
    when the output comes in a tuple."""
    box, walked = _sides(runs, ("callback", "box")), _sides(runs, ("callback", "walked"))
    for rank, ((ours, theirs), (_, reference)) in enumerate(zip(box, walked, strict=True)):
        assert theirs["raised"] == ["ValueError"]
        assert ours["raised"] == [None, None] and ours["states"] == [["IDLE", "IDLE"]] * 2
        _same_training(ours, reference, f"rank {rank}: ours boxed, torch in a tuple")


def test_the_step_after_a_backward_that_raised_is_whole(runs):
    """Step 0's backward raises after the root's pre-backward queued the callback, which then never runs.  Ours
    queues it again at the next backward (the root's forward resets the flag, as torch's
    ``_register_pre_backward_hooks``); torch's root handle, left in BACKWARD_PRE, makes its next forward look like a
    checkpoint's recomputation (``_runtime_utils._pre_forward`` returns early), so step 1 gets no hooks: no
    gradient at all (pinned).  Ours' steps 1 and 2 are torch's steps 1 and 2 without the failed step 0."""
    died, clean = _sides(runs, ("died", False)), _sides(runs, ("died", True))
    for rank, ((ours, theirs), (_, reference)) in enumerate(zip(died, clean, strict=True)):
        assert theirs["raised"][:2] == ["RuntimeError", None] and "FORWARD_BACKWARD" in theirs["states"][1]
        assert all(g is None for _, g in theirs["grads"][1]), "torch: step 1 got gradients"
        assert ours["raised"] == ["RuntimeError", None, None] and ours["states"][1:] == [["IDLE", "IDLE"]] * 2
        assert_bitwise(ours["grads"][1:], reference["grads"], f"rank {rank}: gradients of steps 1 and 2")
        assert_bitwise(ours["full"], reference["full"], f"rank {rank}: full parameters")


# ---------------------------------------------------------------------- 3. a unit called twice
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("prefetch", list(W.PREFETCH))
@pytest.mark.parametrize("shape", list(W.TWICE_SHAPES))
def test_a_unit_called_twice_gathers_in_torch_s_order(runs, shape, prefetch, world):
    """``abad``: the first unit to finish its forward runs again (torch moves its prefetch index to its second
    place, ``_ExecOrderData.record_post_forward``); ``abcbd``: a unit in the middle, with a root Linear."""
    for rank, (ours, theirs) in enumerate(_sides(runs, ("twice_order", shape, prefetch), world)):
        assert len(theirs["backward"]) == W.TWICE_STEPS and all(theirs["backward"])  # the recorder saw them
        _same_training(ours, theirs, f"rank {rank}", ("forward", "backward", "losses", "full"))


# ---------------------------------------------------------------------- 4. MixedPrecision
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("case", W.MP_CASES, ids=lambda c: "-".join(c))
def test_a_unit_called_twice_accumulates_torch_s_bf16_gradients(runs, case, world):
    for rank, (ours, theirs) in enumerate(_sides(runs, ("mp_twice", *case), world)):
        _same_training(ours, theirs, f"rank {rank}")


def test_a_forward_without_backward_under_bf16_leaves_torch_s_gradients_unreduced(runs):
    """A forward whose output is dropped, then the trained one, under bf16.  torch hooks its post-backward on the
    AccumulateGrad node of the first forward since the last backward (``_register_post_backward_hook`` registers
    once; a new node per forward, its flat parameter changing dtype), which that backward never runs: no
    reduction, ``.grad`` is the whole bf16 gradient (pinned).  Ours reduces: torch's gradients without the
    dropped forward."""
    (plain, discard) = _sides(runs, ("mp_discard", False)), _sides(runs, ("mp_discard", True))
    for rank, ((ours_plain, reference), (ours, theirs)) in enumerate(zip(plain, discard, strict=True)):
        used = [(g, shard) for (_, g), (_, shard) in zip(theirs["grads"][0], reference["grads"][0], strict=True)
                if shard is not None]  # (the chain's unused unit has none)
        assert len(used) == 3 and all(g.dtype == torch.bfloat16 and g.numel() > s.numel() for g, s in used), \
            "torch reduced after all"
        assert_bitwise(ours_plain["grads"], reference["grads"], f"rank {rank}: without the dropped forward")
        assert_bitwise(ours["grads"], reference["grads"], f"rank {rank}: ours with it, torch without")


# ---------------------------------------------------------------------- 5. inputs
def test_dataclass_inputs_are_cast_as_torch_casts_them(runs):
    """The root casts a dataclass input's fields to bf16 (``_root_pre_forward`` -> ``_apply_to_tensors``); a module
    class kept in fp32 casts its dataclass input up and its output back to the dtype it cast from
    (``_common_utils._override_module_mixed_precision``'s hooks, the same walk)."""
    for rank, (ours, theirs) in enumerate(_sides(runs, ("mp_inputs",))):
        assert theirs["dtypes"][0] == ["torch.bfloat16"] * 4
        _same_training(ours, theirs, f"rank {rank}", ("dtypes", "losses", "grads", "full"))
