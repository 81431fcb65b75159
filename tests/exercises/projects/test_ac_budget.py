"""Grades project-ac-budget (exercises/projects/ac_budget/README.md): activation checkpointing that fits a budget.

``--impl=student`` grades ``exercises/projects/ac_budget/policy.py``; ``--impl=reference`` the instructor's
solution.  One process, no ranks: the model and the ruler are ``exercises/projects/ac_budget/tower.py``.

Oracles:

* memory: ``run``'s peak, a ``MemoryTracker`` over one forward and backward whose count the census audits
  (``audit == 0``).  A budget is a fraction of the plain model's peak; your blocks, checkpointed by your
  ``apply_checkpointing``, must peak at or under it (exact: bytes are integers, the run is deterministic).
  Fewest: every set of fewer blocks, checkpointed by torch (``torch.distributed.algorithms._checkpoint.
  checkpoint_wrapper`` with ``CheckpointImpl.NO_REENTRANT``, what FSDP's users apply), peaks over it.
  The budgets: 85% of the plain peak (one block fits, and not the widest), 72% (two blocks).
* gradients: torch's autograd on the plain model, the same dropout draws: with your checkpointing applied,
  every gradient bitwise equal.
"""

import functools
import itertools

import pytest
import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    apply_activation_checkpointing,
    checkpoint_wrapper,
)

from exercises.projects.ac_budget.tower import HIDDEN, Tower, make_batch, run
from tests.exercises import impl_module

PROJECT = "project-ac-budget"
NAMES = [f"blocks.{i}" for i in range(len(HIDDEN))]
_TORCH_PEAKS: dict[tuple[str, ...], int] = {}  # a set of blocks -> its peak, checkpointed by torch


def _policy(impl):
    return impl_module("projects.ac_budget.policy", impl)


def _call(fn, *args):
    try:
        return fn(*args)
    except NotImplementedError as e:
        pytest.fail(f"{PROJECT} not done yet: {type(e).__name__}: {e}", pytrace=False)


def _torch_peak(names: tuple[str, ...]) -> int:
    """The peak with ``names`` checkpointed by torch's checkpoint_wrapper (non-reentrant)."""
    if names not in _TORCH_PEAKS:
        model = Tower()
        chosen = {id(model.get_submodule(n)) for n in names}
        wrapper = functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
        apply_activation_checkpointing(model, checkpoint_wrapper_fn=wrapper, check_fn=lambda m: id(m) in chosen)
        _TORCH_PEAKS[names] = run(model, make_batch())["peak"]
    return _TORCH_PEAKS[names]


@pytest.fixture(scope="module")
def plain():
    """The plain model's run: its peak (the budgets' base) and its gradients (the oracle)."""
    out = run(Tower(), make_batch())
    assert out["audit"] == 0 and len(out["grads"]) == 6 * len(HIDDEN) + 2
    _TORCH_PEAKS[()] = out["peak"]
    return out


def _yours(policy, names) -> dict:
    model = Tower()
    _call(policy.apply_checkpointing, model, list(names))
    return run(model, make_batch())


def _same_grads(plain, got) -> list[str]:
    assert got.keys() == plain.keys(), f"parameter names differ: {sorted(got.keys() ^ plain.keys())}"
    return [n for n, g in plain.items() if got[n] is None or not torch.equal(got[n], g)]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("fraction", [0.85, 0.72])
def test_project_ac_budget_fits_with_the_fewest_blocks(impl, plain, fraction):
    policy, budget = _policy(impl), int(fraction * plain["peak"])
    model = Tower()
    names = _call(policy.choose_blocks, model, make_batch(), budget)
    assert _same_grads(plain["grads"], run(model, make_batch())["grads"]) == [], "choose_blocks changed the model"
    assert isinstance(names, (list, tuple)) and len(set(names)) == len(names) and set(names) <= set(NAMES), (
        f"choose_blocks returned {names!r}: a list of distinct block names from {NAMES}")
    got = _yours(policy, names)
    assert got["audit"] == 0, "the census found bytes the tracker missed: the measurement cannot be trusted"
    assert got["peak"] <= budget, (f"budget {budget} bytes ({fraction:.0%} of the plain {plain['peak']}): with "
                                   f"{sorted(names)} checkpointed the peak is {got['peak']}")
    for size in range(len(names)):
        for fewer in itertools.combinations(NAMES, size):
            peak = _torch_peak(fewer)
            assert peak > budget, (f"budget {budget} bytes: you checkpoint {len(names)} blocks {sorted(names)}, but "
                                   f"{list(fewer)} fits with {size} (peak {peak})")
    wrong = _same_grads(plain["grads"], got["grads"])
    assert not wrong, f"with {sorted(names)} checkpointed these gradients differ from the plain model's: {wrong}"


@pytest.mark.timeout(300)
def test_project_ac_budget_refuses_an_impossible_budget(impl, plain):
    """Half the bytes of the parameters' gradients: every backward allocates all of them."""
    policy, model = _policy(impl), Tower()
    budget = sum(p.numel() * p.element_size() for p in model.parameters()) // 2
    with pytest.raises(ValueError):
        _call(policy.choose_blocks, model, make_batch(), budget)


@pytest.mark.timeout(300)
def test_project_ac_budget_keeps_torch_gradients(impl, plain):
    policy = _policy(impl)
    got = _yours(policy, NAMES)
    wrong = _same_grads(plain["grads"], got["grads"])
    assert not wrong, f"with every block checkpointed these gradients differ from the plain model's: {wrong}"
    assert got["peak"] < plain["peak"], f"every block checkpointed peaks at {got['peak']}, the plain model at " \
                                        f"{plain['peak']}: nothing was recomputed"
