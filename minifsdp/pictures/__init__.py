"""Pictures of what the library does: plots for the notebooks, timelines of a step, the route through the core.

Every function draws with matplotlib and returns the figure (or prints text); the chapters show the pictures the
notebooks save in ``chapters/figures/``.

    plots.py           chapters 1, 2.2, 3: ring steps (and a slider over them), DDP bucket timelines, loss curves;
                       save_figure
    fsdp_plots.py      chapter 2 (``02_fsdp_core.md``): shard layouts, the collectives of a step, memory bars
    parallel_plots.py  chapter 4.4: a pipeline's timeline, how tensor parallelism cuts two Linears
    fsdp2_plots.py     chapter 5: FSDP1's flat shard beside FSDP2's per-parameter rows
    tracing.py         chapters 2.5, 3.3: a per-rank event timeline of an FSDP step (Gantt plot, Chrome trace,
                       torch.profiler trace)
    route.py           chapter 2: python -m minifsdp route, the route one traced FSDP1 step takes through the
                       core's files
"""
