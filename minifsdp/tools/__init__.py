"""The programs around the book: the main jobs, benchmarks, plots and timelines.

    cli.py              ``python -m minifsdp compare | bench ...``
    compare.py          the main job: ours against torch's, side by side
    bench*.py           benchmarks, always a ratio against torch measured in the same run, on one harness
                        (bench_harness.py: ranks, contenders in turns, medians, the ratio table)
    tracing.py          a per-rank event timeline of an FSDP step (Gantt plot, Chrome trace)
    viz.py, viz_fsdp.py plots and widgets for the notebooks

Everything here may import any chapter's code; nothing in a chapter imports from here.
"""
