"""The graded tasks and projects of the course (``exercises/``), and how a test finds the code it grades.

A task's tests never import a solution by name: they ask :func:`impl_module` for the module under test,
and compute what it must return from the library or from torch (the oracle).  So the student edition,
which has no ``exercises/solutions/``, runs the very same tests against the learner's code.

What ``python -m minifsdp course grade`` relies on (``minifsdp/tools/course.py``):

* a test's task: ``test_task2_2a_...`` grades task ``2.2a``; a test under ``tests/exercises/projects/``
  grades ``project-<name>``, named by its folder (``projects/zero1/test_*.py``) or its file
  (``projects/test_zero1.py``, ``projects/test_noshard_accum_bytes.py``), ``_`` read as ``-``; every task
  has a row in ``exercises/points.csv`` (``tests/test_course.py`` checks both ways);
* a stub raises ``NotImplementedError("Task 2.2a: ring_reduce_scatter -- see ...")`` (a project's
  ``"Project zero1: step -- see ..."``): its failure then reads in one line, on a rank too;
* every stub module (a file under ``exercises/`` that raises ``NotImplementedError``) has its answer at
  the same path under ``exercises/solutions/`` (``projects/zero1/zero1.py`` ->
  ``solutions/projects/zero1/zero1.py``) defining the same names and importing only the library and
  torch, so copying it over the stub earns the task's points (``tests/test_exercise_solutions.py``).
"""

import importlib
from types import ModuleType


def impl_module(name: str, impl: str) -> ModuleType:
    """The module a task's tests grade: ``exercises.<name>`` (the learner's, ``--impl=student``) or, with
    ``--impl=reference`` in the full repository, ``exercises.solutions.<name>`` (the instructor's answer,
    left out of the student edition).  ``name`` is dotted from ``exercises/``, e.g. ``"ring_collectives"``
    or ``"projects.zero1.zero1"``."""
    if impl not in ("reference", "student"):
        raise ValueError(f"impl is 'reference' or 'student', got {impl!r}")
    prefix = "exercises.solutions." if impl == "reference" else "exercises."
    try:
        return importlib.import_module(prefix + name)
    except ModuleNotFoundError as e:
        if impl == "reference" and e.name and e.name.startswith("exercises.solutions"):
            raise ModuleNotFoundError(f"no reference solution {prefix + name}: this is the student edition "
                                      "(grade your own code with --impl=student)", name=e.name) from e
        raise
