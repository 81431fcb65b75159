"""The fault task 5.3 plants in the open (``exercises/README_fsdp2.md``): the learner writes the test that catches it.

Every other planted fault lives in ``catalog.py``, which the student edition leaves out (its entries are the
answers of the find-the-bug lab).  This one is the exercise's given, so it sits apart: the student edition keeps
this file, grades task 5.3 with it (``tests/exercises/test_catch_fault_exercises.py``), and plants it with
``MINIFSDP_PLANT_FAULT=reshard_keeps_full_parameters`` (``plant.py``).  Every FSDP2 test a learner is given
passes with it (the list is in the exercise's text).
"""

from __future__ import annotations

from tests.planted_faults.plant import Fault

__all__ = ["TASK_5_3_FAULT"]

TASK_5_3_FAULT = Fault(
    name="reshard_keeps_full_parameters",
    plants="a group's reshard puts the sharded parameters back on the modules but never frees the full ones: "
           "every all-gathered buffer stays allocated, so FSDP2 holds the whole model unsharded",
    target="minifsdp.fsdp2.core.param:FSDPParam.to_sharded",
    old="free_storage(self.full_padded)",
    new="pass",
    test="exercises/fsdp2_catch_fault.py::test_catches_the_planted_fault",
    why="the numbers do not change (every gather refills the same buffer), so no parity test sees it; the "
        "learner's test must look at memory (task 5.3)",
)
