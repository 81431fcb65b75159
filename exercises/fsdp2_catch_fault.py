"""Task 5.3: write the test that catches a fault every FSDP2 test you are given misses.

The grader plants a fault in ``minifsdp.fsdp2`` (in memory, never on disk: ``tests/planted_faults/plant.py``):
a group's reshard puts the sharded parameters back on the modules but never frees the full ones.  Every test of
``fully_shard`` you are given still passes with it.  Write :func:`test_catches_the_planted_fault` so that it
passes on minifsdp as it is and fails with the fault planted.  The task text and hints are in
``exercises/README_fsdp2.md``.  Grade with::

    pytest tests/exercises --impl=student -k task5_3

A plain function, no pytest fixtures: the grader calls it once in its own process (the code as it is) and once
in a fresh process with the fault planted in it and in every rank it starts.  Rank functions you pass to
``minifsdp.spawn`` must be defined at module level here (the ranks import them by name).
"""

from __future__ import annotations


def test_catches_the_planted_fault() -> None:
    """Task 5.3.  Pass on minifsdp as it is; fail when a group's reshard does not free its full parameters."""
    raise NotImplementedError("Task 5.3: test_catches_the_planted_fault -- see exercises/README_fsdp2.md")
