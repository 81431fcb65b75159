"""Where the student edition's library runs the learner's own code (``python -m minifsdp course student-copy``).

A few library functions are the answers of graded tasks (the textbook ring is tasks 2.2a-c).  The student
edition cuts them out, like minitorch: each region between two comments in the library source

    # >>> student edition: cut; exercises/ring_collectives.py runs here (tasks 2.2a-c)
    def ring_reduce_scatter(output, input, op="sum", group=None): ...
    # <<< student edition

becomes, in the copy, one stub per function that calls the learner's function of the same task through
:func:`learner_function`.  So in the student edition the learner's code *is* the library's code there:
``python -m minifsdp compare --collectives textbook`` trains on their ring, and a library test of the ring
tests theirs.  Until the task is done, the stub's ``NotImplementedError("Task 2.2a: ...")`` is what the
library raises there.  ``minifsdp/classroom/course_cut.py`` writes the stubs.

In this repository (the instructor's) nothing calls it: the library's own bodies are in place.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from typing import Callable

__all__ = ["learner_function", "ROOT"]

ROOT = Path(__file__).resolve().parents[1]  # the repository (or student edition) whose exercises/ we run


def learner_function(task: str, module: str, name: str, stub: Callable) -> Callable:
    """The learner's ``name`` from ``module`` (``"exercises.ring_collectives"``), which the library's ``stub``
    calls in the student edition; a ``NotImplementedError`` naming ``task`` when there is none to call."""
    where = f"{module.replace('.', '/')}.py {name}"
    if (ROOT / "exercises").is_dir() and str(ROOT) not in sys.path:
        sys.path.append(str(ROOT))  # a library installed from this folder, run from elsewhere
    try:
        found = getattr(importlib.import_module(module), name, None)
    except ImportError as e:
        raise NotImplementedError(f"Task {task}: {name} -- the student edition runs your {where} here, "
                                  f"and it cannot be imported ({e})") from e
    if not callable(found):
        raise NotImplementedError(f"Task {task}: {name} -- the student edition runs your {where} here: "
                                  "it is missing")
    if found is stub:
        raise NotImplementedError(f"Task {task}: {name} -- your {where} is the library's, which the student "
                                  "edition cuts out (this is where yours runs): write your own")
    return found
