"""The find-the-bug lab's faults: planted faults of chapters 2-5, and how a student can find each.

``LAB``: a fault's name in ``catalog.py`` -> (the chapter, the way the chapter's tools show it, what it
looks like).  ``python -m minifsdp course bug`` plants one per lab (``minifsdp/classroom/course_bug.py``); its
grading runs the fault's catalog test (``Fault.test``) on a clean copy of the library with the student's
version of the planted file in place: ``tests/test_planted_faults.py`` proves in CI that each of those tests
fails with the fault planted and passes without it.  Instructor only: the student edition leaves this file out
with the catalog.

The ways (``WAYS``), the tools chapters 2-5 teach:

    compare      ``python -m minifsdp compare`` and its flags (``course_bug.COMMANDS``): ours against torch
                 in one run, step by step; a MISMATCH, "within tol" where bitwise was due, or a crash
    step table   ``python -m minifsdp train --log-json`` of ours against ``--impl torch-fsdp1`` (or the
                 test's own run against torch): the loss and grad-norm columns part
    trace        ``train --profile`` (per-rank Chrome traces) or the recorded order of collectives: the
                 numbers never change, the order does
    census       the memory census (``minifsdp.memory``), ``count_bytes()``, the state trace, ``plan``
                 against a measurement: what is held or sent, not the numbers
    tests        the chapter's tests against torch's own (a layout, a refusal, a loaded checkpoint)

What compare showed for its faults, planted on disk (2 cores, 8 steps; "3 ranks" is ``--world-size 3
--collectives torch``): ring_chunk_index MISMATCH 0.0472 at 2 ranks; padded_size_rounds_down a RuntimeError
while wrapping (size 30 against 32); end_padding_not_zero MISMATCH 42 (the padding);
divide_factor_post_forgotten MISMATCH 0.000294; fp16_divide_once_before_sum and three_rank_divide_factors_swapped
"within tol" (2.49e-06); fully_shard_copy_out_offset MISMATCH 0.0478 (``--impl fsdp2``, 3 ranks).
"""

WAYS = ("compare", "step table", "trace", "census", "tests")
THREE = "compare --world-size 3 --collectives torch"

LAB = {
    # ------------------------------------------------------------ 2.1: the flat parameter, the gradient's average
    "padded_size_rounds_down": ("2.1", "compare", f"{THREE}: every rank fails while wrapping (size 30 against 32)"),
    "end_padding_not_zero": ("2.1", "compare", f"{THREE}: losses equal, parameters 42 apart from step 0"),
    "last_rank_shard_range": ("2.1", "tests", "the last rank's range stops at the last real number: its padding is "
                                              "in nobody's shard (torch FSDP1's shards against ours)"),
    "divide_factor_post_forgotten": ("2.1", "compare", f"{THREE}: MISMATCH from step 0 (gradients 1.5x)"),
    "fp16_divide_once_before_sum": ("2.1", "compare", f"{THREE}: 'within tol' where bitwise was due"),
    "three_rank_divide_factors_swapped": ("2.1", "compare", f"{THREE}: 'within tol' where bitwise was due"),
    "plan_of_reads_the_wrong_row": ("2.1", "census", "SHARD_GRAD_OP frees its parameters after the forward: the "
                                                     "numbers stay, its memory is FULL_SHARD's"),
    "no_reshard_after_forward": ("2.1", "census", "FULL_SHARD keeps every unit gathered from its forward to its "
                                                  "backward: the state trace and the peak show it, not the numbers"),
    "no_sync_scope": ("2.1", "census", "inside no_sync() the units still reduce-scatter: count_bytes() counts "
                                       "them, the gradients come out sharded"),
    # ------------------------------------------------------------ 2.2: the ring
    "ring_chunk_index": ("2.2", "compare", "compare at 2 ranks: the parameters part at step 0, the losses at step 1"),
    "comm_stream_keeps_last_job": ("2.2", "census", "a collective's tensors outlive it: the census after it counts "
                                                    "what the comm stream still holds"),
    "tuned_ring_keeps_scratch": ("2.2", "census", "the tuned ring keeps its scratch buffers between collectives: "
                                                  "only the census sees them"),
    # ------------------------------------------------------------ 2.3-2.4: memory and bytes, predicted
    "plan_padding_forgotten": ("2.3", "census", "python -m minifsdp plan predicts fewer bytes than the census "
                                                "measures where a unit pads"),
    "plan_second_all_gather_not_counted": ("2.4", "census", "plan's bytes per FULL_SHARD step fall short of what "
                                                            "count_bytes() counts"),
    "plan_root_gathered_twice": ("2.4", "census", "plan's bytes per FULL_SHARD step count the root's all-gather "
                                                  "twice (torch keeps the root from its forward)"),
    "orig_params_write_back_skipped": ("2.4", "step table", "use_orig_params: a parameter changed between steps is "
                                                            "silently restored; the next losses part from torch's"),
    "orig_params_frozen_at_wrap_stay_detached": ("2.4", "step table", "use_orig_params: a weight unfrozen "
                                                                      "after wrapping never trains"),
    # ------------------------------------------------------------ 2.5: prefetch
    "prefetch_direction": ("2.5", "trace", "the numbers stay bitwise; the backward's all-gathers come in the wrong "
                                           "order (train --profile; train --impl student --student 2.5 names it)"),
    "backward_post_prefetches_forward_neighbour": ("2.5", "trace", "BACKWARD_POST: each next all-gather comes after "
                                                                   "this unit's reduce-scatter, not before it"),
    # ------------------------------------------------------------ 3: in practice
    "clip_local_norm": ("3.2", "step table", "the grad_norm column differs from torch FSDP1's from step 1; the "
                                             "losses part after"),
    # ------------------------------------------------------------ 4: mixed precision, checkpoints
    "reduce_in_param_dtype": ("4.1", "step table", "--mixed-precision with an fp32 reduce_dtype: the last bits "
                                                   "part from torch FSDP1's"),
    "no_shard_mp_accumulation_overwrites": ("4.1", "step table", "NO_SHARD, mixed precision, two micro-batches: "
                                                                 "the second gradient replaces the first"),
    "scaler_found_inf_not_all_reduced": ("4.1", "step table", "fp16: a rank whose shard has no inf steps while "
                                                              "the others skip"),
    "checkpoint_piece_keys_global_rank": ("4.3", "tests", "HYBRID_SHARD at 4 ranks: global rank 2 saves its "
                                                          "pieces at shard rank 2's offsets"),
    "piece_table_offset_off_by_one": ("4.3", "tests", "a sharded save's pieces are one number off where a shard "
                                                      "boundary cuts a parameter"),
    "resume_rng_not_restored": ("4.3", "step table", "a resumed run's losses part from the run that never stopped"),
    "lax_load_raises_on_missing_keys": ("4.3", "tests", "load_state_dict(strict=False) of an incomplete dict "
                                                        "raises, where torch loads the rest"),
    # ------------------------------------------------------------ 5: fully_shard
    "fully_shard_copy_out_offset": ("5", "compare", "compare --impl fsdp2 --world-size 3 --collectives torch: the "
                                                    "loss barely falls"),
    "fully_shard_fp16_factor_floored": ("5", "step table", "fp16 reduce at 3 ranks: gradients 1.5x torch FSDP2's"),
    "fully_shard_bf16_summed_not_averaged": ("5", "step table", "bf16 reduce at 3 ranks: gradients 3x torch "
                                                                "FSDP2's"),
    "shard_placement_dim_unchecked": ("5", "tests", "Shard(1) for a bias: an IndexError deep inside, where torch "
                                                    "refuses the call"),
}
