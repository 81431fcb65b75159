"""The graded tasks and projects of the course (``exercises/``), and how a test reaches the code it grades.

The process that grades never imports the learner's code (``minifsdp/classroom/course_remote.py`` says why):

* a test asks the fixture ``learner`` for a stand-in of the module under test (``learner("launch_tasks")``);
  each function called on it runs in the learner's process, under the task's rules, and hands back plain data;
* ranks are the learner's processes too: a rank function imports the module itself (:func:`impl_module`),
  runs it under the task's rules (``course_rules.enforce_here``), and returns its outputs as bytes
  (``course_remote.to_bytes``) that the test reads back (``from_bytes``);
* the test computes what the code must return itself, from torch or from the definition (the oracle), in its
  own process or in a spawn that runs no learner code, and compares.  Inputs are drawn from the grading seed
  (``--course-seed``, the ``course_seed`` fixture) where a fixed input could be answered by a lookup.

What ``python -m minifsdp course grade`` relies on (``minifsdp/classroom/points.py``):

* a test's task: ``test_task2_2a_...`` grades task ``2.2a``; a test under ``tests/exercises/projects/``
  grades ``project-<name>``, named by its folder (``projects/zero1/test_*.py``) or its file
  (``projects/test_zero1.py``, ``projects/test_noshard_accum_bytes.py``), ``_`` read as ``-``; every task
  has a row in ``exercises/points.csv`` (``tests/test_course.py`` checks both ways);
* ``@pytest.mark.points(n)`` on a project's tests: its points are shared by weight among its test functions
  (a function earns its share when every case of it passes); a task without it earns all or nothing;
* a stub raises ``NotImplementedError("Task 2.2a: ring_reduce_scatter -- see ...")`` (a project's
  ``"project-zero1: step -- see ..."``): while it is in the file the task reads "not done yet";
* every stub module (a file under ``exercises/`` that raises ``NotImplementedError``) has its answer at
  the same path under ``exercises/solutions/`` (``projects/zero1/zero1.py`` ->
  ``solutions/projects/zero1/zero1.py``) defining the same names and importing only the library and
  torch, so copying it over the stub earns the task's points (``tests/test_exercise_solutions.py``).
"""

import importlib
from types import ModuleType


def module_name(name: str, impl: str) -> str:
    """The dotted name of the module a task's tests grade: ``exercises.<name>`` (the learner's,
    ``--impl=student``) or ``exercises.solutions.<name>`` (the instructor's answer, ``--impl=reference``).
    ``name`` is dotted from ``exercises/``, e.g. ``"ring_collectives"`` or ``"projects.zero1.zero1"``."""
    if impl not in ("reference", "student"):
        raise ValueError(f"impl is 'reference' or 'student', got {impl!r}")
    return ("exercises.solutions." if impl == "reference" else "exercises.") + name


def impl_module(name: str, impl: str) -> ModuleType:
    """The module itself: for a rank (a learner's process), never for the grading process."""
    try:
        return importlib.import_module(module_name(name, impl))
    except ModuleNotFoundError as e:
        if impl == "reference" and e.name and e.name.startswith("exercises.solutions"):
            raise ModuleNotFoundError(f"no reference solution {module_name(name, impl)}: this is the student "
                                      "edition (grade your own code with --impl=student)", name=e.name) from e
        raise


# ------------------------------------------------------------------------------------------ ranks of the learner's
GROUP_TIMEOUT_S = 15.0  # a learner's group: a deadlock times out in seconds (an honest step takes milliseconds)


def learner_group(members):
    """A process group for the learner's calls (every rank must create it), with a short timeout: a rank that
    waits for a message no one sends fails with gloo's "Timed out waiting ..." within seconds."""
    import datetime

    import torch.distributed as dist

    return dist.new_group(list(members), timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S))


def learner_ranks(fn, args: tuple, world_size: int, timeout_s: float = 120.0) -> list:
    """``minifsdp.spawn(fn, args, world_size)`` for a rank function that runs the learner's code and returns
    ``course_remote.to_bytes`` of its outputs: every rank's outputs, read back as data only.  A rank that died or
    hung fails the test in one line: the learner's file and line, and the exception (gloo's, for a deadlock)."""
    import minifsdp
    from minifsdp.classroom.course_remote import failure_in_text, from_bytes
    from minifsdp.launch import RankFailedError

    try:
        raw = minifsdp.spawn(fn, args=args, world_size=world_size, timeout_s=timeout_s)
    except RankFailedError as e:
        raise AssertionError(f"rank {e.rank}: {failure_in_text(e.detail)}") from None
    if not all(isinstance(b, bytes) for b in raw):
        raise AssertionError("a rank answered something that is not the grader's bytes")
    return [from_bytes(b) for b in raw]


def outcome_line(result: dict) -> str:
    """A learner call's failure (``course_remote.capture``'s ``raised``) in one line."""
    from minifsdp.classroom.course_remote import describe

    return describe(result["raised"])


def anyone_failed(failed: bool) -> bool:
    """On every rank of a learner's spawn: whether any rank's last learner call failed (the grader's collective,
    outside the task's rules), so every rank skips what would wait for a rank that gave up."""
    import torch
    import torch.distributed as dist

    from minifsdp.classroom.course_rules import enforce

    flag = torch.tensor([float(failed)])
    with enforce(()):
        dist.all_reduce(flag)
    return bool(flag.item())


_SECONDARY = ("Connection closed by peer", "Connection reset by peer", "remote worker crashing")


def root_causes_first(lines: list[str]) -> list[str]:
    """Failure lines with a rank's own failure before those that only lost a peer (a peer's crash or time-out)."""
    return sorted(lines, key=lambda line: any(h in line for h in _SECONDARY))
