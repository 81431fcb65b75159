"""The instructor's answers, one module per stub module of ``exercises/`` and of the same name.

``tests/exercises/__init__.py::module_name`` names ``exercises.solutions.<name>`` to a task's tests under
``--impl=reference`` and the learner's ``exercises.<name>`` under ``--impl=student``, and either runs in the
learner's process, never in the grader's; the tests compute what each function must return from the library
or from torch, never from these files.  Where the library is the answer, the student edition cuts it out of
its library (``minifsdp/classroom/course_cut.py``: a stub there calls the learner's function instead), so the
answer here is written out, never imported from the library; so is the answer to a task whose function the
library keeps (its chapters run it: 1.1, 2.3a, 3.2a, 4.2), because a task's rules forbid importing the
library's own answer (``course_rules.ANSWERED_BY``).  A library function a task builds on but does not
rebuild (2.5's prefetch order, 4.1a's dtypes) is re-exported.  Every module imports only ``minifsdp`` and
torch and obeys its task's rules (``minifsdp/classroom/course_rules.py``), so copying it over its stub
(``exercises/solutions/ring_collectives.py`` -> ``exercises/ring_collectives.py``) gives a stub module that
earns every point, in the student edition too: CI does exactly that there.

The student edition (``python -m minifsdp course student-copy DIR``) leaves this folder out.

    ddp_bucketing.py       1.1         written here (DDP's own is minifsdp.ddp.buckets.assign_buckets)
    launch_tasks.py        1.3         torch.utils.data.DistributedSampler's cut, written here
    fsdp_tasks.py          2.1a-c      written here: flatten and shard, unflatten, the reduce-scatter, the clip
    ring_collectives.py    2.2a-c      written here (the library's textbook ring is cut from the student edition)
    memory_tasks.py        2.3a-b, 2.4 written here (2.3a: the paper's formula, as zero_formulas.model_state_bytes)
    overlap_tasks.py       2.5, 4.1a-b minifsdp.fsdp.core.prefetch, .mixed_precision; 4.1b written here
    config_tasks.py        2.5b, 3.1   written here: the corrected torch FSDP1 call, consolidation for serving
    practice_tasks.py      3.2a-b, 3.3 written here (3.2a: the train job's lr_factor)
    hf_tasks.py            4.2         written here (as minifsdp.fsdp.core.wrap.transformer_auto_wrap_policy)
    checkpoint_tasks.py    4.3a-b      written here (the library's save_pieces, load_shard are cut)
    parallel_tasks.py      4.4a-b      written here (RowwiseParallel's math; the 1F1B order)
    fsdp2_tasks.py         5.1-5.2     written here (FSDPParam's layout, from torch.chunk's rule)
    fsdp2_catch_fault.py   5.3         written here: a test that catches a planted FSDP2 fault
"""
