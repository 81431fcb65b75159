"""Three regimes against torch FSDP1, each case torch-FSDP1 user code run on torch and on ours in one spawn.

1. The order of all-gathers and reduce-scatters in every forward and backward, for every ``backward_prefetch``
   (BACKWARD_PRE, BACKWARD_POST, None), with and without ``forward_prefetch`` and ``limit_all_gathers``, under
   FULL_SHARD and SHARD_GRAD_OP, on three wrap shapes: an ``nn.Sequential`` of Linears wrapped by
   ``ModuleWrapPolicy({nn.Linear})`` (a root with no parameters of its own, the common setup), a root that keeps
   a Linear, and a unit with its own parameters around a nested unit; and, under bf16 MixedPrecision with and
   without ``forward_prefetch``, two such units in a row (each BatchNorm a unit of its own inside its block);
   and the model run twice before each backward, with ``forward_prefetch``; a unit called twice in one forward, with
   ``forward_prefetch``; a frozen first unit the backward never reaches, under SHARD_GRAD_OP (kept gathered into
   the next step), use_orig_params False and True; a unit the backward reaches only through a frozen original
   (use_orig_params: it reduce-scatters); under SHARD_GRAD_OP, a forward under ``no_grad`` then an edit written
   back inside ``summon_full_params`` before each step (the kept full parameters are used, not gathered again),
   and the same edit not written back (the kept buffer still computes with it);
   and ``summon_full_params(with_grads=True)`` after each backward
   (every collective with its dtype, ``minifsdp.fuzz.record.CollectiveRecorder``).  Three steps each:
   ``forward_prefetch`` prefetches from the second on.
   Oracle: torch's c10d ops recorded in the same run (``tests/_workers_overlap.CollectiveLog``), each named by its
   numel (the units' padded flat sizes all differ); exact.  Losses and full parameters: bitwise.
2. ``requires_grad`` changed after wrapping, both ways (frozen at wrap and unfrozen after a step, as progressive
   unfreezing does; and the reverse), use_orig_params False (a whole unit) and True (one weight inside a unit).
   Oracle: torch FSDP1; bitwise: every gradient (None where torch's is None), the reduce-scatters of each
   backward, the losses and the full parameters after each step.
3. ``load_state_dict`` of incomplete (a parameter or a buffer missing) and over-full (keys no module has) dicts,
   strict and not, through an FSDP root and a plain module above FSDP units, FULL / SHARDED / LOCAL.
   Oracle: torch FSDP1: the error's type and the keys its message names, the missing and unexpected keys
   returned, the full parameters after; bitwise.

A case that fails because ours differs from torch is a strict xfail naming the cause.
"""

import pytest

from minifsdp import spawn
from tests import _workers_regimes_torch as W
from tests._selection import module_name
from tests._workers_fsdp import assert_bitwise

_REGIME_OF = {"test_collective_order_in_each_step_is_torch_s": "order",
              "test_requires_grad_changed_after_wrapping_trains_as_torch": "requires_grad",
              "test_load_state_dict_of_wrong_dicts_as_torch": "load"}


@pytest.fixture(scope="module")
def regimes(request):
    """The cases this session selected, in one spawn (one test alone, as a planted fault runs it, runs one case)."""
    only = set()
    for item in request.session.items:
        regime = _REGIME_OF.get(getattr(item, "originalname", None))
        if regime is not None and module_name(item) == __name__:
            case = item.callspec.params["item" if regime == "load" else "case"]
            only.add((regime, tuple(case[:-1]) if regime == "load" else case))
    results = spawn(W.all_regimes, (tuple(W.REGIMES), only), world_size=2, timeout_s=300)
    assert len(results) == 2
    return results


def _both(regimes, regime: str, case: tuple) -> list[tuple[dict, dict]]:
    """(ours, torch's) on each rank, neither an error."""
    out = []
    for rank, per_rank in enumerate(regimes):
        res = per_rank[regime][case]
        for side in ("ours", "torch"):
            assert "error" not in res[side], f"rank {rank}, {side}: {res[side]['error']}"
        out.append((res["ours"], res["torch"]))
    return out


def _ids(case: tuple) -> str:
    return "-".join(str(c) for c in case)


# ---------------------------------------------------------------------- 1. the order of collectives
@pytest.mark.parametrize("case", W.ORDER_CASES, ids=_ids)
def test_collective_order_in_each_step_is_torch_s(regimes, case):
    for rank, (ours, theirs) in enumerate(_both(regimes, "order", case)):
        assert len(theirs["backward"]) == W.ORDER_STEPS and all(theirs["backward"])  # the recorder saw them
        for step in range(W.ORDER_STEPS):
            assert ours["forward"][step] == theirs["forward"][step], f"rank {rank} step {step} forward"
            assert ours["backward"][step] == theirs["backward"][step], f"rank {rank} step {step} backward"
        assert ("summon" in ours) == ("summon" in theirs) == (case[-1] == "summon_with_grads")
        for step, (o, t) in enumerate(zip(ours.get("summon", []), theirs.get("summon", []), strict=True)):
            assert o == t, f"rank {rank} step {step} summon_full_params(with_grads=True)"
        assert_bitwise(ours["losses"], theirs["losses"], f"rank {rank} losses")
        assert_bitwise(ours["full"], theirs["full"], f"rank {rank} full parameters")


# ---------------------------------------------------------------------- 2. requires_grad changed after wrapping
@pytest.mark.parametrize("case", W.REQUIRES_GRAD_CASES, ids=_ids)
def test_requires_grad_changed_after_wrapping_trains_as_torch(regimes, case):
    for rank, (ours, theirs) in enumerate(_both(regimes, "requires_grad", case)):
        assert theirs["requires_grad"][0] != theirs["requires_grad"][1]  # the change happened, on torch too
        assert len(ours["grads"]) == len(theirs["grads"]) == W.STEPS
        for step in range(W.STEPS):
            what = f"rank {rank} step {step}"
            assert ours["requires_grad"][step] == theirs["requires_grad"][step], what
            assert_bitwise(ours["grads"][step], theirs["grads"][step], f"{what} gradients")
            assert ours["reductions"][step] == theirs["reductions"][step], f"{what} reduce-scatters"
            assert_bitwise(ours["full"][step], theirs["full"][step], f"{what} full parameters")
        assert_bitwise(ours["losses"], theirs["losses"], f"rank {rank} losses")


# ---------------------------------------------------------------------- 3. load_state_dict of wrong dicts
LOAD_ITEMS = [(*c, how) for c in W.LOAD_CASES for how in W.WRONG]


@pytest.mark.parametrize("item", LOAD_ITEMS, ids=_ids)
def test_load_state_dict_of_wrong_dicts_as_torch(regimes, item):
    """Strict: torch's error type and the keys it names; not strict: torch's missing and unexpected keys and the
    parameters it loaded.  After a refused strict load through an FSDP root, ours leaves the model as it was where
    torch has copied every matching key before raising (on purpose: ``load_full_state_dict`` in
    minifsdp/fsdp/state_dict_type.py checks every key before copying any); through a plain root, nn.Module's
    load copies first on both sides."""
    *case, how = item
    for rank, (ours, theirs) in enumerate(_both(regimes, "load", tuple(case))):
        o, t = ours[how], theirs[how]
        what = f"rank {rank} {how}"
        assert o[True] == t[True], f"{what} strict: ours {o[True]} vs torch {t[True]}"
        assert o[False] == t[False], f"{what} not strict: ours {o[False]} vs torch {t[False]}"
        assert_bitwise(o["full_after_False"], t["full_after_False"], f"{what} parameters after the lax load")
        if t[True][0] == "raised" and case[0] == "fsdp" and not t["untouched_True"]:  # torch copied, then raised
            assert o["untouched_True"], what
        else:
            assert_bitwise(o["full_after_True"], t["full_after_True"], f"{what} parameters after the strict load")
