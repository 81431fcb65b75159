"""The course's projects: problems whose answers are not in the library, each graded against torch.

    zero1/           project-zero1          ZeRO-1: the optimizer state sharded, against ZeroRedundancyOptimizer
    hybrid/          project-hybrid         HYBRID_SHARD's two-level gradient reduction from ring collectives
    noshard_accum/   project-noshard-accum  gradient accumulation under no_sync: FULL_SHARD against SHARD_GRAD_OP
    ac_budget/       project-ac-budget      activation checkpointing that fits a memory budget

Each folder holds a README (the goal, the oracle, what to read, hints), the starter code and nothing else;
the tests are ``tests/exercises/projects/test_<folder>.py``.
"""
