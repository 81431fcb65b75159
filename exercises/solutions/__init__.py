"""The instructor's answers, one module per stub module of ``exercises/`` and of the same name.

``tests/exercises/__init__.py::module_name`` names ``exercises.solutions.<name>`` to a task's tests under
``--impl=reference`` and the learner's ``exercises.<name>`` under ``--impl=student``, and either runs in the
learner's process, never in the grader's; the tests compute what each function must return from the library
or from torch, never from these files.  Where the library is the answer, the module re-exports the library's
function under the stub's name (and signature); where it is not, the answer is written here.  Every module
imports only ``minifsdp`` and torch and obeys its task's rules (``minifsdp/tools/course_rules.py``), so
copying it over its stub (``exercises/solutions/ring_collectives.py`` -> ``exercises/ring_collectives.py``)
gives a stub module that earns every point: CI does that in the student edition for some of them.

The student edition (``python -m minifsdp course student-copy DIR``) leaves this folder out.

    ddp_bucketing.py       1.1         minifsdp.ddp.buckets.assign_buckets
    launch_tasks.py        1.3         torch.utils.data.DistributedSampler's cut, written here
    fsdp_tasks.py          2.1a-c      written here: flatten and shard, unflatten, the reduce-scatter, the clip
    ring_collectives.py    2.2a-c      minifsdp.comm.ring (the textbook ring)
    memory_tasks.py        2.3a-b, 2.4 minifsdp.memory.zero_formulas
    overlap_tasks.py       2.5, 4.1a-b minifsdp.fsdp.core.prefetch, .mixed_precision; 4.1b written here
    config_tasks.py        2.5b, 3.1   written here: the corrected torch FSDP1 call, consolidation for serving
    practice_tasks.py      3.2a-b, 3.3 minifsdp.tools.train.lr_factor, minifsdp.tools.train_monitor
    hf_tasks.py            4.2         minifsdp.fsdp.core.wrap.transformer_auto_wrap_policy
    checkpoint_tasks.py    4.3a-b      minifsdp.checkpoint.pieces
    parallel_tasks.py      4.4a-b      written here (RowwiseParallel's math); 4.4b from pipeline_schedules
    fsdp2_tasks.py         5.1-5.2     written here (FSDPParam's layout, from torch.chunk's rule)
    fsdp2_catch_fault.py   5.3         written here: a test that catches a planted FSDP2 fault
"""
