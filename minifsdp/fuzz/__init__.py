"""A differential fuzzer: random but seeded FSDP programs, run on torch's FSDP and on ours, compared bit for bit.

torch's own test suites test torch's programs.  Users write others: a block that returns a dataclass,
gradients accumulated in bf16 over three backwards, a state dict taken between two steps.  The fuzzer draws
such programs from a seed and runs each on both sides in the same ranks, comparing what a user would see:
losses, gradients, parameters, dtypes, state dicts, the order of collectives, the exceptions raised.
Chapter 6 (``chapters/06_when_fsdp_goes_wrong.md``, "Beyond the reports") shows what it found.

    program.py    a program as data, drawn from a seed             python -m minifsdp fuzz --cases N --seed S
    trees.py      the models programs build                         [--impl fsdp1|fsdp2] [--shrink]
    sides.py      torch's classes or ours, behind torch's names
    record.py     what is recorded: tensors as users see them, the collectives issued
    run.py        one program on one side, on one rank
    compare.py    where two records differ (bitwise)
    known.py      where torch is the one that is wrong, and why
    campaign.py   many programs in few spawns
    shrink.py     a difference made small, and printed as a standalone script
"""

from minifsdp.fuzz.campaign import Outcome, campaign, run_batch
from minifsdp.fuzz.program import Program, draw

__all__ = ["Program", "draw", "campaign", "run_batch", "Outcome"]
