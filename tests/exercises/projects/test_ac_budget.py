"""Grades project-ac-budget (exercises/projects/ac_budget/README.md): activation checkpointing that fits a budget.

``--impl=student`` grades ``exercises/projects/ac_budget/policy.py``; ``--impl=reference`` the instructor's
solution.  No ranks: the model and the ruler are ``exercises/projects/ac_budget/tower.py`` (the instructor's copy:
the grader never takes it from a learner).  The learner's functions run in the learner's process, and so does the
ruler that measures what they did (:func:`probe_choose`, :func:`probe_apply`: a peak, an audit, gradients);
torch's checkpointing and the plain model are measured here.  Points by test (``@pytest.mark.points``).

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
import importlib
import itertools

import pytest
import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    apply_activation_checkpointing,
    checkpoint_wrapper,
)

from exercises.projects.ac_budget.tower import HIDDEN, Tower, make_batch, run
from minifsdp.classroom.course_remote import capture, raise_again
from tests.exercises import module_name

PROJECT = "project-ac-budget"
NAMES = [f"blocks.{i}" for i in range(len(HIDDEN))]
_TORCH_PEAKS: dict[tuple[str, ...], int] = {}  # a set of blocks -> its peak, checkpointed by torch


def probe_apply(name: str, names) -> dict:
    """In the learner's process: a fresh Tower with ``names`` checkpointed by the learner, measured by the ruler."""
    model = Tower()
    got = capture(importlib.import_module(name).apply_checkpointing, model, list(names))
    return got if "raised" in got else {"value": run(model, make_batch())}


def probe_choose(name: str, budget: int) -> dict:
    """In the learner's process: the learner's choice for ``budget``, the model it was given measured afterwards
    (it must be unchanged), and a fresh Tower with the chosen blocks checkpointed, measured."""
    model = Tower()
    got = capture(importlib.import_module(name).choose_blocks, model, make_batch(), budget)
    if "raised" in got:
        return got
    names = got["value"]
    after = run(model, make_batch())["grads"]
    ok = isinstance(names, (list, tuple)) and all(isinstance(n, str) for n in names)
    return {"value": {"names": list(names) if ok else repr(names)[:200], "after": after,
                      "yours": probe_apply(name, names) if ok else None}}


def _in_learner(learner_process, impl, probe: str, *args):
    got = learner_process.call(f"tests.exercises.projects.test_ac_budget:{probe}", (PROJECT,),
                               (module_name("projects.ac_budget.policy", impl), *args))
    if "raised" in got:
        raise_again(got["raised"])
    return got["value"]


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


def _same_grads(plain, got) -> list[str]:
    assert got.keys() == plain.keys(), f"parameter names differ: {sorted(got.keys() ^ plain.keys())}"
    return [n for n, g in plain.items() if got[n] is None or not torch.equal(got[n], g)]


@pytest.mark.timeout(600)
@pytest.mark.points(15)
@pytest.mark.parametrize("fraction", [0.85, 0.72])
def test_project_ac_budget_fits_with_the_fewest_blocks(impl, learner_process, plain, fraction):
    budget = int(fraction * plain["peak"])
    chosen = _in_learner(learner_process, impl, "probe_choose", budget)
    names = chosen["names"]
    assert _same_grads(plain["grads"], chosen["after"]) == [], "choose_blocks changed the model"
    assert isinstance(names, list) and len(set(names)) == len(names) and set(names) <= set(NAMES), (
        f"choose_blocks returned {names!r}: a list of distinct block names from {NAMES}")
    if "raised" in chosen["yours"]:
        raise_again(chosen["yours"]["raised"])
    got = chosen["yours"]["value"]
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
@pytest.mark.points(4)
def test_project_ac_budget_refuses_an_impossible_budget(learner, plain):
    """Half the bytes of the parameters' gradients: every backward allocates all of them."""
    model = Tower()
    budget = sum(p.numel() * p.element_size() for p in model.parameters()) // 2
    with pytest.raises(ValueError):
        learner("projects.ac_budget.policy").choose_blocks(model, make_batch(), budget)


@pytest.mark.timeout(300)
@pytest.mark.points(6)
def test_project_ac_budget_keeps_torch_gradients(impl, learner_process, plain):
    got = _in_learner(learner_process, impl, "probe_apply", NAMES)
    wrong = _same_grads(plain["grads"], got["grads"])
    assert not wrong, f"with every block checkpointed these gradients differ from the plain model's: {wrong}"
    assert got["peak"] < plain["peak"], f"every block checkpointed peaks at {got['peak']}, the plain model at " \
                                        f"{plain['peak']}: nothing was recomputed"
