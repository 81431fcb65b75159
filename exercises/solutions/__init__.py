"""The instructor's answers, one module per stub module of ``exercises/`` and of the same name.

``tests/exercises/__init__.py::module_name`` names ``exercises.solutions.<name>`` to a task's tests under
``--impl=reference`` and the learner's ``exercises.<name>`` under ``--impl=student``, and either runs in the
learner's process, never in the grader's; the tests compute what each function must return from the library
or from torch, never from these files.  Where the library is the answer, the student edition cuts it out of
its library (``minifsdp/tools/course_cut.py``: a stub there calls the learner's function instead), so the
answer here is written out, never imported from the library; where the library keeps a function a task also
asks for (it runs every chapter's code), the module re-exports it.  Every module imports only ``minifsdp`` and
torch and obeys its task's rules (``minifsdp/tools/course_rules.py``), so copying it over its stub
(``exercises/solutions/ring_collectives.py`` -> ``exercises/ring_collectives.py``) gives a stub module that
earns every point, in the student edition too: CI does exactly that there.

The student edition (``python -m minifsdp course student-copy DIR``) leaves this folder out.

    ddp_bucketing.py       1.1         minifsdp.ddp.buckets.assign_buckets (DDP's own)
    launch_tasks.py        1.3         torch.utils.data.DistributedSampler's cut, written here
    fsdp_tasks.py          2.1a-c      written here: flatten and shard, unflatten, the reduce-scatter, the clip
    ring_collectives.py    2.2a-c      written here (the library's textbook ring is cut from the student edition)
    memory_tasks.py        2.3a-b, 2.4 2.3a minifsdp.memory.zero_formulas.model_state_bytes; 2.3b, 2.4 written here
    overlap_tasks.py       2.5, 4.1a-b minifsdp.fsdp.core.prefetch, .mixed_precision; 4.1b written here
    config_tasks.py        2.5b, 3.1   written here: the corrected torch FSDP1 call, consolidation for serving
    practice_tasks.py      3.2a-b, 3.3 3.2a minifsdp.tools.train.lr_factor; 3.2b, 3.3 written here
    hf_tasks.py            4.2         minifsdp.fsdp.core.wrap.transformer_auto_wrap_policy
    checkpoint_tasks.py    4.3a-b      written here (the library's save_pieces, load_shard are cut)
    parallel_tasks.py      4.4a-b      written here (RowwiseParallel's math; the 1F1B order)
    fsdp2_tasks.py         5.1-5.2     written here (FSDPParam's layout, from torch.chunk's rule)
    fsdp2_catch_fault.py   5.3         written here: a test that catches a planted FSDP2 fault
"""
