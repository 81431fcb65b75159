"""The benchmarks: ours against torch, always a ratio measured in the same run, on one harness.

Chapter 2 (``chapters/02_fsdp_core.md``: 2.2 the ring's speed, 2.3 the largest model that fits, 2.4-2.5 what a
step costs, prefetching; its appendix ``02_fsdp_core_deeper.md``) and chapter 4.1 (mixed precision) quote them.

    harness.py       what every bench shares: ranks started, contenders in turns, medians, the ratio table, JSON
    collectives.py   bench collectives: our ring all-reduce against gloo's (chapter 2.2)
    fit.py           the latency-bandwidth (alpha-beta) model of a collective, fitted to measured times (2.2)
    step_costs.py    what one step costs each rank: bytes, collectives, memory, time (notebook 02's cells)
    fsdp.py          bench fsdp: ours against torch FSDP1, FSDP2 and DDP (2.4)
    fsdp_cuda.py     bench fsdp --device cuda: the same on GPUs
    overlap.py       bench overlap / precision: prefetch settings (2.5); mixed precision, checkpointing (4.1)
    scale.py         bench scale: the largest TinyGPT that trains under a per-rank memory limit (2.3)
    zero.py          DeepSpeed's ZeRO-2 and ZeRO-3 beside torch FSDP1 and ours (2.3; needs deepspeed)

A benchmark is a command (``python -m minifsdp bench ...``), never a test: performance is a ratio, not a time.
"""
