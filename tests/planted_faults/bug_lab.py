"""The find-the-bug lab's faults: planted faults that ``python -m minifsdp compare`` shows, and under which flags.

``REVEALED_BY``: a fault's name in ``catalog.py`` -> compare's flags under which ours and torch's agree
bitwise without the fault and stop agreeing with it: a MISMATCH verdict, "within tol" where bitwise was
due, or a crash.  ``python -m minifsdp course bug`` draws one of them by its seed
(``minifsdp/tools/course_bug.py``, whose printed commands include every flag set here); its grading runs
compare with the drawn fault's flags.  Instructor only: the student edition leaves this file out with the
catalog.

What compare showed for each, with the fault planted on disk (2 cores, 8 steps, every flag set of
course_bug.COMMANDS tried; the faults not listed agreed bitwise under all of them: they change memory,
order, or paths compare does not take, and the tests in the catalog catch them instead):

    ring_chunk_index                   default (ring)              MISMATCH, max |param diff| 0.0472
    padded_size_rounds_down            --world-size 3 (torch)      RuntimeError: size 30 against 32, rank 2
    end_padding_not_zero               --world-size 3 (torch)      MISMATCH, max |param diff| 42 (the padding)
    divide_factor_post_forgotten       --world-size 3 (torch)      MISMATCH, max |param diff| 0.000294
    fp16_divide_once_before_sum        --world-size 3 (torch)      within tol, max |param diff| 2.49e-06
    three_rank_divide_factors_swapped  --world-size 3 (torch)      within tol, max |param diff| 2.49e-06
    fully_shard_copy_out_offset        --impl fsdp2 --world-size 3 MISMATCH, max |param diff| 0.0478
"""

THREE_RANKS = ("--world-size", "3", "--collectives", "torch")

REVEALED_BY = {
    "ring_chunk_index": (),
    "padded_size_rounds_down": THREE_RANKS,
    "end_padding_not_zero": THREE_RANKS,
    "divide_factor_post_forgotten": THREE_RANKS,
    "fp16_divide_once_before_sum": THREE_RANKS,
    "three_rank_divide_factors_swapped": THREE_RANKS,
    "fully_shard_copy_out_offset": ("--impl", "fsdp2", "--world-size", "3", "--collectives", "torch"),
}
