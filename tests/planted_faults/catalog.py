"""The planted faults: each a realistic one-line bug, and the named fast test that must catch it.

``tests/test_planted_faults.py`` plants each fault (``plant.py``: the function recompiled in memory with
``old`` replaced by ``new``, in every process the test starts) and asserts that its named test fails,
and that the same test passes on the code as it is.  A new feature of the core proves its tests by
adding its fault here: the bug a developer would plausibly write, and the test that would catch it.

Prefer a test that is fast and says what went wrong: a single-process check where one exists, else
the smallest spawn that compares with torch.  The named test must catch the fault *by its purpose*
(a memory or state fault through state, not through numbers that happen to differ).
"""

from __future__ import annotations

from tests.planted_faults.plant import Fault
from tests.planted_faults.task_faults import TASK_5_3_FAULT

__all__ = ["FAULTS", "EXERCISE_FAULTS", "by_name"]

GRADIENT = "minifsdp.fsdp.core.gradient"
PLAN = "minifsdp.fsdp.core.strategy:ShardingPlan.divide_factors"

FAULTS = [
    # ------------------------------------------------------------------ flat parameters (chapter 2.1)
    Fault(
        name="padded_size_rounds_down",
        plants="padded_size rounds the flat length down to a multiple of N, not up (the last numbers lost)",
        target="minifsdp.fsdp.core.flat_param:padded_size",
        old="return -(-numel // world_size) * world_size",
        new="return numel // world_size * world_size",
        test="tests/test_flat_param.py::test_order_padding_and_shards",
        why="one process, no spawn: 11 numbers on 4 ranks must pad to 12 (shards of 3), the example the "
            "flat_param docstring draws",
    ),
    Fault(
        name="end_padding_not_zero",
        plants="flatten fills the end padding with 42 (torch's debug marker for alignment gaps), not zeros",
        target="minifsdp.fsdp.core.flat_param:flatten",
        old="flat = torch.zeros(layout.padded_numel,",
        new="flat = torch.full((layout.padded_numel,), 42.0,",
        test="tests/test_flat_param.py::test_shard_ranges_are_torch_fsdp1_shards[5-4]",
        why="one process: each rank's shard against torch FSDP1's own _get_shard (zero-padded); 5 numbers on 4 "
            "ranks leave rank 2 one padding number and rank 3 all padding",
    ),
    Fault(
        name="last_rank_shard_range",
        plants="shard_range ends the last rank's range at the last real number, not at the padded end",
        target="minifsdp.fsdp.core.flat_param:FlatParamLayout.shard_range",
        old="return rank * self.shard_numel, (rank + 1) * self.shard_numel",
        new="return rank * self.shard_numel, min((rank + 1) * self.shard_numel, self.numel)",
        test="tests/test_flat_param.py::test_shard_ranges_are_torch_fsdp1_shards[7+6-3]",
        why="one process: every rank's range against torch FSDP1's _get_shard; 13 numbers on 3 ranks end in 2 "
            "padding numbers, which the last range must include",
    ),
    # ------------------------------------------------------------------ the step (chapter 2)
    Fault(
        name="no_reshard_after_forward",
        plants="the post-forward never frees: FULL_SHARD keeps a unit's full parameters from its forward to its "
               "backward (as SHARD_GRAD_OP), whatever the plan says",
        target="minifsdp.fsdp.core.fsdp:FullyShardedDataParallel._post_forward",
        old="free=not self.is_root and self.plan.frees_after_forward",
        new="free=False",
        test="tests/test_fsdp_state.py::test_after_forward_every_unit_awaits_its_backward",
        why="the numbers do not change (only memory does), so a parity test cannot see it; the state trace "
            "asserts that after the forward every non-root unit's HandleState is SHARDED",
    ),
    Fault(
        name="prefetch_direction",
        plants="the backward prefetches the unit after this one in the forward order (already done), "
               "not the one before it",
        target="minifsdp.fsdp.core.prefetch:prefetch_target",
        old="(post_forward, -1)",
        new="(post_forward, 1)",
        test="tests/test_prefetch.py::test_execution_order_unit",
        why="a prefetch never changes the numbers; one process, the rule itself: after forwards b, c, a the "
            "backward of a prefetches c, of c b (the 2-rank all-gather order against torch FSDP1 catches it too)",
    ),
    Fault(
        name="no_sync_scope",
        plants="no_sync() stops only the root from reducing; the units inside it still reduce-scatter",
        target="minifsdp.fsdp.core.fsdp:FullyShardedDataParallel.no_sync",
        old="inside = units(self)",
        new="inside = [self]",
        test="tests/test_torch_api_more.py::test_no_sync_shows_the_accumulated_unsharded_grads_at_two_ranks",
        why="2 ranks, nested units, against torch FSDP1: inside no_sync each gradient must be the accumulated "
            "full-shape local one, so a reduced (sharded, averaged) gradient differs in shape and numbers",
    ),
    Fault(
        name="plan_of_reads_the_wrong_row",
        plants="ShardingPlan.of gives SHARD_GRAD_OP FULL_SHARD's row: it frees after the forward (ZeRO-3, not 2)",
        target="minifsdp.fsdp.core.strategy:ShardingPlan.of",
        old="ShardingStrategy.FULL_SHARD if strategy is None else strategy",
        new="ShardingStrategy.FULL_SHARD if strategy in (None, ShardingStrategy.SHARD_GRAD_OP) else strategy",
        test="tests/test_fsdp_core.py::test_sharding_plan_answers_as_torch_fsdp1_decides[SHARD_GRAD_OP]",
        why="one process: the plan's answers against torch FSDP1's own strategy sets (the numbers of a run would "
            "not change, only its memory)",
    ),
    # ------------------------------------------------------------------ gradient averaging (chapter 2.1)
    Fault(
        name="divide_factor_post_forgotten",
        plants="each gradient is divided by f before the sum and the sum never by N / f",
        target=PLAN,
        old="return pre, self.data_parallel_size / pre",
        new="return pre, 1.0",
        test="tests/test_fsdp_core.py::test_core_class_alone_is_bitwise_torch_fsdp1[3ranks-mlp]",
        why="at 2 ranks N / f = 1 and the fault is invisible; the core class alone at 3 ranks against torch FSDP1 "
            "(N / f = 1.5): gradients 1.5x, so losses and shards differ",
    ),
    Fault(
        name="fp16_divide_once_before_sum",
        plants="each gradient is divided by N once before the sum, not by f before and N / f after",
        target=PLAN,
        old="pre = predivide_factor(self.data_parallel_size)",
        new="pre = float(self.data_parallel_size)",
        test="tests/test_mixed_precision.py::test_fp16_small_gradients_at_4_ranks_bitwise_vs_torch_fsdp1[FULL_SHARD]",
        why="exact in fp32 at 2 and 4 ranks (powers of two) and identical at 2 (f = N); fp16 at 4 ranks with "
            "gradients near fp16's smallest normal rounds differently from torch's /2, sum, /2",
    ),
    Fault(
        name="three_rank_divide_factors_swapped",
        plants="each gradient is divided by N / f before the sum and the sum by f (the two factors swapped)",
        target=PLAN,
        old="pre = predivide_factor(self.data_parallel_size)",
        new="pre = self.data_parallel_size / predivide_factor(self.data_parallel_size)",
        test="tests/test_fsdp_parity.py::test_bitwise_vs_torch_fsdp1_3_ranks[mlp-FULL_SHARD-sgd]",
        why="at 2 and 4 ranks both factors are powers of two (1 and 2, or 2 and 2) and every order is exact in "
            "fp32; at 3 ranks torch divides by 2 before (exact) and 1.5 after, the fault by 1.5 before, once per "
            "rank, which rounds each rank's gradient.  (Summing first and dividing by 3 after is exact-equal to "
            "torch's order in fp32 at 3 ranks, since /2 is exact: only fp16's small numbers tell it apart)",
    ),
    # ------------------------------------------------------------------ mixed precision (chapter 4.1)
    Fault(
        name="reduce_in_param_dtype",
        plants="the reduce-scatter runs in param_dtype (bf16), not in reduce_dtype (fp32)",
        target=f"{GRADIENT}:UnitGradient.start_reduce",
        old="h.dtypes.reduce, self.predivide",
        new="h.dtypes.param, self.predivide",
        test="tests/test_mixed_precision.py::test_bitwise_vs_torch_fsdp1_mixed_precision[bf16_fp32reduce-FULL_SHARD]",
        why="the one MixedPrecision case whose reduce_dtype differs from its param_dtype, bitwise against torch "
            "FSDP1: a bf16 sum rounds where torch's fp32 sum does not",
    ),
    Fault(
        name="no_shard_mp_accumulation_overwrites",
        plants="NO_SHARD + param_dtype: a second backward's gradient overwrites flat_param.grad instead of adding",
        target=f"{GRADIENT}:UnitGradient.take_cast_grad",
        old="acc += g",
        new="acc.copy_(g)",
        test="tests/test_mixed_precision.py::test_no_shard_bf16_gradient_accumulation_bitwise_vs_torch_fsdp1"
             "[no_sync-flat_grads]",
        why="the only path where autograd does not accumulate for us (our bf16 leaf is apart from flat_param); "
            "two backwards, the first inside no_sync, gradients after each against torch FSDP1",
    ),
    Fault(
        name="scaler_found_inf_not_all_reduced",
        plants="ShardedGradScaler.unscale_ keeps each rank's own found_inf: a rank whose shard has no inf steps",
        target="minifsdp.fsdp.grad_scaler:ShardedGradScaler.unscale_",
        old="dist.all_reduce(found, group=self.process_group)",
        new="pass",
        test="tests/test_mixed_precision.py::test_sharded_grad_scaler_skips_on_every_rank",
        why="an inf injected into rank 1's gradient shard only: every rank must skip that step, as torch's "
            "ShardedGradScaler does",
    ),
    # ------------------------------------------------------------------ clipping (chapter 3.2)
    Fault(
        name="clip_local_norm",
        plants="clip_grad_norm_ uses each rank's local norm (no all-reduce of the squared norms)",
        target="minifsdp.fsdp.full_params:clip_grad_norm_",
        old="dist.all_reduce(total, group=group)",
        new="pass",
        test="tests/test_torch_api_more.py::test_empty_local_pieces_have_no_grad_and_clip_as_torch_at_two_ranks"
             "[2.0]",
        why="2 ranks against torch FSDP1: the returned total norm and every clipped gradient; the source's own "
            "mistake (chapter 3.2), planted in the library",
    ),
    # ------------------------------------------------------------------ checkpoints (chapter 4.3)
    Fault(
        name="checkpoint_piece_keys_global_rank",
        plants="a sharded save cuts each rank's pieces by its global rank, not its rank in the shard group",
        target="minifsdp.fsdp.param_pieces:piece_table",
        old="layout.shard_range(h.groups.shard_rank if h.sharded else 0)",
        new="layout.shard_range(dist.get_rank() if h.sharded else 0)",
        test="tests/test_checkpoint.py::test_sharded_save_at_hybrid_layout_keys_pieces_by_shard_rank",
        why="the two ranks coincide at 2 ranks and in the first replica; HYBRID_SHARD with shard groups {0, 1}, "
            "{2, 3} is the smallest layout where global rank 2 is shard rank 0",
    ),
    Fault(
        name="piece_table_offset_off_by_one",
        plants="the piece table places each parameter one number later in its unit's flat buffer than it is",
        target="minifsdp.fsdp.param_pieces:piece_table",
        old="cut = overlap(slot.offset, slot.numel, start, end)",
        new="cut = overlap(slot.offset + 1, slot.numel, start, end)",
        test="tests/test_piece_table.py::test_piece_table_is_torch_fsdp1_shard_metadata[False]",
        why="3 ranks against torch FSDP1's own shard metadata (its _shard_param_infos), row by row: a range "
            "one number off shows on the first parameter a shard boundary cuts",
    ),
    Fault(
        name="resume_rng_not_restored",
        plants="restore_rng puts back Python's and NumPy's generators but not torch's",
        target="minifsdp.checkpoint.resume:restore_rng",
        old='torch.set_rng_state(state["torch"])',
        new="pass",
        test="tests/test_checkpoint.py::test_resume_is_bitwise_the_run_that_never_stopped",
        why="its training masks inputs at random with torch's generator, so a resumed run takes the run that "
            "never stopped's steps only if that generator came back",
    ),
    # ------------------------------------------------------------------ fully_shard (chapter 5)
    Fault(
        name="fully_shard_copy_out_offset",
        plants="fully_shard's all-gather copy-out never advances its offset: every parameter reads the first one's "
               "columns",
        target="minifsdp.fsdp2.core.collectives:AllGatherResult.copy_out",
        old="torch.split_with_sizes_copy(self.rows, self.numels, dim=1, out=outs)",
        new="[o.copy_(self.rows[:, :n]) for o, n in zip(outs, self.numels)]",
        test="tests/test_fsdp2.py::test_parity_with_torch_fsdp2_world_3",
        why="the smallest fully_shard spawn against torch FSDP2 (3 ranks, 2 cases, 2 steps), with odd widths "
            "whose shards are uneven and padded",
    ),
    Fault(
        name="fully_shard_fp16_factor_floored",
        plants="fully_shard's fp16 gradient divide: the factor after the sum is floor-divided (3 // 2 = 1, not 1.5)",
        target="minifsdp.fsdp2.core.collectives:gradient_divide_factors",
        old='return float(pre), factor / pre, "sum", "sum"',
        new='return float(pre), factor // pre, "sum", "sum"',
        test="tests/test_fsdp2.py::test_half_precision_gradient_reduction_world_3[fp16_reduce]",
        why="3 ranks, the smallest world size where fp16's factor after the sum is not a whole number (2 ranks: "
            "2 before, 1 after; 4 ranks: 2 and 2): gradients 1.5x too large, bitwise against torch FSDP2",
    ),
    Fault(
        name="shard_placement_dim_unchecked",
        plants="fully_shard checks only that shard_placement_fn's dim is not negative, not that the parameter has it",
        target="minifsdp.fsdp2.placement:resolve_placements",
        old="if not 0 <= dim < p.ndim:",
        new="if dim < 0:",
        test="tests/test_fsdp2.py::test_a_shard_dim_the_parameter_lacks_is_refused_at_the_call_as_torch",
        why="Shard(1) for a Linear's 1-D bias: torch raises AssertionError naming the dim; unchecked, ours fails "
            "later with an IndexError that names neither the parameter nor the fix",
    ),
    Fault(
        name="orig_params_write_back_skipped",
        plants="use_orig_params: a parameter given new storage between steps is re-pointed at the shard without "
               "its numbers being copied in, so the user's change is silently lost",
        target="minifsdp.fsdp.orig_params:OrigParams.write_back_originals",
        old='flat.data[lo:hi].copy_(_checked(now.detach(), hi - lo, h.sharded, slot.fqn, "parameter"))',
        new='_checked(now.detach(), hi - lo, h.sharded, slot.fqn, "parameter")',
        test="tests/test_torch_api_more.py::test_use_orig_params_writes_back_what_the_user_changed_as_torch"
             "[FULL_SHARD-data-2]",
        why="2 ranks, a weight's .data replaced after a step, against torch FSDP1: the next losses and the full "
            "parameters differ",
    ),
    # ------------------------------------------------------------------ the bench harness
    Fault(
        name="bench_ratio_inverted",
        plants="the bench harness states a ratio as the reference over the contender, so a slower one reads faster",
        target="minifsdp.bench.harness:ratio",
        old="return value / reference",
        new="return reference / value",
        test="tests/test_bench_harness.py::test_medians_and_ratios_read_a_slower_contender_above_one",
        why="one process, no spawn, a fake clock: a contender whose median step is 1.5x the reference's must read "
            "1.5, the reference 1.0 (every bench's 'x FSDP1' column goes through this ratio)",
    ),
    # ------------------------------------------------------------------ pitfalls named (chapter 6)
    Fault(
        name="wrap_fingerprint_without_its_negative",
        plants="the wrap check all-reduces [h, h] instead of [h, -h], so the MAX never yields the minimum and every "
               "wrap, even an identical one, looks like a disagreement",
        target="minifsdp.fsdp.pitfalls:check_same_unit_on_all_ranks",
        old="both = torch.tensor([mine, -mine],",
        new="both = torch.tensor([mine, mine],",
        test="tests/test_pitfalls.py::test_ranks_that_wrap_differently_are_named_not_hung",
        why="its own small 2-rank spawn: the disagreeing wrap must be named on both ranks, and the same wrap on "
            "both ranks must pass silently (here it raises)",
    ),
    Fault(
        name="load_check_reads_the_wrong_state",
        plants="the load check looks for units in PRE_BACKWARD (inside a backward) instead of AWAITING_BACKWARD, so "
               "a load after a forward whose backward never ran passes unnamed",
        target="minifsdp.fsdp.pitfalls:check_load_awaits_backward",
        old="u.training_state is TrainingState.AWAITING_BACKWARD",
        new="u.training_state is TrainingState.PRE_BACKWARD",
        test="tests/test_pitfalls.py::test_load_between_forward_and_backward_is_named",
        why="the chapter's 2-rank spawn: FULL and LOCAL loads after an undifferentiated forward must raise the "
            "named error",
    ),
    Fault(
        name="hybrid_warning_reads_the_data_parallel_size",
        plants="the HYBRID_SHARD warning tests the data-parallel size (shard x replicate) for 1 instead of the shard "
               "group's size, so a shard group of 1 on 2 ranks goes unnamed",
        target="minifsdp.fsdp.pitfalls:warn_hybrid_shard_of_one",
        old="groups.shard_size != 1",
        new="groups.data_parallel_size != 1",
        test="tests/test_pitfalls.py::test_hybrid_shard_of_one_synchronises_and_says_so",
        why="the chapter's 2-rank spawn: the warning must appear once, beside torch FSDP1's replicas drifting apart",
    ),
    Fault(
        name="torch_dcp_check_reads_only_its_caller",
        plants="the check for torch's get_state_dict looks at the frame that called it (ours' state_dict) and stops, "
               "never reaching torch's checkpoint module further up, so torch's API reads ours as a plain module",
        target="minifsdp.fsdp.pitfalls:check_not_torch_dcp",
        old="        frame = frame.f_back",
        new="        frame = None",
        test="tests/test_pitfalls.py::test_torch_get_state_dict_on_ours_fsdp1_is_refused_with_the_api_to_use",
        why="the chapter's 2-rank spawn: torch's get_state_dict must raise on ours, naming the API to use",
    ),
    Fault(
        name="fsdp2_optimizer_check_skips_gradless",
        plants="the FSDP2 optimizer check only looks at parameters that have a gradient, and an unsharded parameter "
               "never has one at the step, so an optimizer built after a forward steps it unnamed",
        target="minifsdp.fsdp2.pitfalls:check_optimizer",
        old="if UNSHARDED in p.__dict__:",
        new="if UNSHARDED in p.__dict__ and p.grad is not None:",
        test="tests/test_pitfalls.py::test_fsdp2_optimizer_built_before_sharding_or_after_a_forward_is_named",
        why="the chapter's 2-rank spawn: an optimizer built after a forward (with and without grad) must be refused, "
            "naming 'net.2.weight'",
    ),
    Fault(
        name="fsdp2_optimizer_check_skips_gradless_originals",
        plants="the FSDP2 optimizer check looks for replaced originals only among parameters that have a gradient, "
               "and an original never gets one after fully_shard, so an optimizer built before it steps unnamed",
        target="minifsdp.fsdp2.pitfalls:check_optimizer",
        old="if REPLACED in p.__dict__:",
        new="if REPLACED in p.__dict__ and p.grad is not None:",
        test="tests/test_pitfalls.py::test_fsdp2_optimizer_built_before_sharding_or_after_a_forward_is_named",
        why="the chapter's 2-rank spawn: an optimizer built before fully_shard must be refused, naming 'weight' of "
            "Linear (torch steps nothing there, silently)",
    ),
    # ------------------------------------------------------------------ the plan (chapters 2.3, 2.4)
    Fault(
        name="plan_padding_forgotten",
        plants="the plan shards each unit as unit // N elements per rank, forgetting FSDP's padding to a multiple of N",
        target="minifsdp.memory.plan:_shards",
        old="return [math.ceil(u / g) for u in shape.unit_numels(run.wrap)]",
        new="return [u // g for u in shape.unit_numels(run.wrap)]",
        test="tests/test_plan_measured.py::test_model_state_equals_the_census[2]",
        why="the book's models divide by 2 and 4, so the measured set has an MLP whose 429-number unit pads at 2 "
            "ranks: its shards, gradients and moments each hold one padding number the census counts",
    ),
    Fault(
        name="plan_second_all_gather_not_counted",
        plants="the plan forgets FULL_SHARD's second all-gather, in the backward (counts it as SHARD_GRAD_OP)",
        target="minifsdp.memory.plan:collectives",
        old='if run.strategy in ("FULL_SHARD", "HYBRID_SHARD") and kept < 1:',
        new="if False:",
        test="tests/test_plan_measured.py::test_bytes_sent_equal_count_bytes[2]",
        why="count_bytes() around a real FULL_SHARD step at 2 ranks counts every unit but the root gathered twice",
    ),
    Fault(
        name="plan_root_gathered_twice",
        plants="the plan gathers FULL_SHARD's root unit again in the backward (torch keeps it from its forward)",
        target="minifsdp.memory.plan_fsdp2:kept_after_forward",
        old='if (root and unit == 0) or value == "false":',
        new='if value == "false":',
        test="tests/test_plan_real_scale.py::test_llama_7b_at_64_ranks_against_the_formulas",
        why="one process: llama-7b at 64 ranks sends 3 x 4P(N-1)/N less one all-gather of its 262M-number root",
    ),
    Fault(
        name="plan_link_speed_in_bytes",
        plants="the plan divides bytes by a link speed in bits per second (the factor 8 forgotten): every network "
               "time 8x too short",
        target="minifsdp.memory.plan_time:_seconds",
        old="return 8 * c.bytes_sent / (gpu.inter_node_bps if c.across_nodes else gpu.intra_node_bps)",
        new="return c.bytes_sent / (gpu.inter_node_bps if c.across_nodes else gpu.intra_node_bps)",
        test="tests/test_plan_worked_example.py::test_network_and_compute_time_are_the_hand_worked_values[8]",
        why="one process: chapter 2.3 works Llama 2 7B's network time at 8 H100s by hand, 34,917,922,816 bytes x 8 "
            "bits at 3,600 Gbit/s = 0.0776 s; ratios of network times, all 8x off, would not notice",
    ),
    # ------------------------------------------------------------------ the ring (chapter 2.2)
    Fault(
        name="ring_chunk_index",
        plants="the ring reduce-scatter receives into the chunk it sends (off by one), not the one before it",
        target="minifsdp.comm.ring:reduce_scatter_chunks",
        old="(rank - step - 2) % n",
        new="(rank - step - 1) % n",
        test="tests/comm/test_ring_in_one_process.py::test_ring_sim_equals_the_sum",
        why="one process, no spawn: the simulated ring checks that each rank receives the chunk its left "
            "neighbour sends, and its result against the plain sum, at several N (the 8-rank spawn of the real "
            "ring hangs for 150 s under this fault)",
    ),    # ------------------------------------------------------------------ the course's grader
    Fault(
        name="grader_counts_a_skipped_test",
        plants="course grade gives a task its points when one of its tests was skipped (only failures count)",
        target="minifsdp.classroom.points:score",
        old='bad = [c for c in mine if c["outcome"] != "passed"]',
        new='bad = [c for c in mine if c["outcome"] in ("failed", "error")]',
        test="tests/test_course.py::test_points_come_from_every_test_of_a_task_passing",
        why="one process: a task whose only test was skipped (no transformers installed) must earn nothing, or a "
            "class whose machines skip a task would get its points for no work",
    ),
    # ------------------------------------------------------------------ what the collectives keep (chapter 2.2)
    Fault(
        name="comm_stream_keeps_last_job",
        plants="a comm stream's thread keeps the job it last ran (a closure over the collective's tensors) until "
               "the next job comes",
        target="minifsdp.comm.stream:CommStream._run",
        old="job = None  # Note (a finished job is dropped)",
        new="pass  # Note (a finished job is dropped)",
        test="tests/comm/test_comm_keeps_nothing.py::test_a_collective_keeps_nothing_once_done[textbook-3]",
        why="one process, thread-ranks: the textbook ring keeps nothing of its own, so the async collectives' "
            "tensors outliving their caller's references can only be the stream's",
    ),
    Fault(
        name="tuned_ring_keeps_scratch",
        plants="the tuned ring keeps its scratch buffers on the group's comm stream, for the next collective",
        target="minifsdp.comm.tuned.collectives:_seat",
        old="Seat(group, None, stream.doorbells)",
        new="Seat(group, stream.__dict__.setdefault('workspace', {}), stream.doorbells)",
        test="tests/comm/test_comm_keeps_nothing.py::test_a_collective_keeps_nothing_once_done[ring-3]",
        why="one process, thread-ranks: the census after the collectives must find only the posted header "
            "receives; the caller's tensors die either way, so only the census sees it",
    ),
    Fault(
        name="torch_collectives_wait_before_let_go",
        plants="get_collectives('torch')'s wait() returns when gloo marks the work done, while its worker thread "
               "still holds the tensors",
        target="minifsdp.comm.collectives:LettingGoWork.wait",
        old="while _holders(self._aliases) != self._own",
        new="while False",
        test="tests/comm/test_comm_keeps_nothing.py::test_torch_collectives_let_go_before_wait_returns",
        why="one process, one gloo rank, its worker thread made slow to let go: the race that made the census "
            "of NO_SHARD at rest count one unit's gradient (tests/test_memory_vs_torch.py), made certain",
    ),
    Fault(
        name="torch_collectives_wait_for_cpp_only",
        plants="get_collectives('torch')'s wait() waits for the C++ references to the tensor only, not for its "
               "Python object (the thread that drops the last C++ one needs the GIL to drop that)",
        target="minifsdp.comm.collectives:LettingGoWork.wait",
        old="while _holders(self._aliases) != self._own",
        new="while [h[0] for h in _holders(self._aliases)] != [h[0] for h in self._own]",
        test="tests/comm/test_comm_keeps_nothing.py::test_torch_collectives_let_go_before_wait_returns",
        why="the race that failed a clean CI run (about 1 wait in 70 under a Timer thread: the tensor's memory "
            "freed 5 ms, one GIL switch, after wait() returned), made certain by a second, later hold",
    ),
    # ------------------------------------------------------------------ a test run leaves the checkout as it was
    Fault(
        name="save_figure_ignores_the_switch",
        plants="save_figure writes into chapters/figures/ on every run, switch or not (a test run dirties the clone)",
        target="minifsdp.pictures.plots:save_figure",
        old="if os.environ.get(SAVE_FIGURES_ENV) != \"1\":",
        new="if False:",
        test="tests/test_repo_hygiene.py::test_notebooks_save_figures_into_the_checkout_only_when_asked",
        why="one process: save_figure on a repository of its own in tmp_path, without the switch, must write "
            "nothing there",
    ),
    # ------------------------------------------------------------------ the training job's resume (chapter 4.3)
    Fault(
        name="train_scaler_state_not_saved",
        plants="python -m minifsdp train saves no grad scaler state: an fp16 run resumes with a fresh scale",
        target="minifsdp.training.train:_save",
        old='"scaler": scaler.state_dict() if scaler is not None else None',
        new='"scaler": None',
        test="tests/test_train_resume.py::test_resume_is_bitwise_the_run_that_never_stopped[ours-fp16]",
        why="the scale had backed off to 32768 at the checkpoint; a fresh 65536 overflows the next step, which is "
            "then skipped: its gradient norm and the later losses differ",
    ),
    Fault(
        name="train_torch_checkpoint_rng_of_rank_0",
        plants="a torch-fsdp1/fsdp2 checkpoint gives every rank rank 0's RNG state on resume",
        target="minifsdp.training.impls:load_torch_checkpoint",
        old="return extras[dist.get_rank()] if len(extras) == dist.get_world_size() else extras[0]",
        new="return extras[0]",
        test="tests/test_train_resume.py::test_resume_is_bitwise_the_run_that_never_stopped[torch-fsdp2-bf16]",
        why="the job's dropout draws from each rank's generator: rank 1 resumed with rank 0's draws rank 0's masks",
    ),
    Fault(
        name="train_log_keeps_crashed_steps",
        plants="a resume keeps the log lines of the steps after its checkpoint (a crash's steps are logged twice)",
        target="minifsdp.training.train:_open_log",
        old='json.loads(line)["step"] <= start',
        new='json.loads(line)["step"] > 0',
        test="tests/test_train_resume.py::test_resume_is_bitwise_the_run_that_never_stopped[ours-fp32]",
        why="the resume starts from step 2 while the log already holds steps 3 and 4",
    ),
    # ------------------------------------------------------------------ FSDP1 regimes against torch
    Fault(
        name="backward_post_prefetches_forward_neighbour",
        plants="BACKWARD_POST's prefetch asks for the unit after this one in the forward order (its backward is "
               "done, so nothing is prefetched), not the one the backward needs next",
        target="minifsdp.fsdp.core.fsdp:FullyShardedDataParallel._post_backward_reshard",
        old="self._prefetch(self._root._root_state.order.next_in_backward, in_backward=True)",
        new="self._prefetch(self._root._root_state.order.next_in_forward, in_backward=True)",
        test="tests/test_fsdp_regimes_torch.py::"
             "test_collective_order_in_each_step_is_torch_s[linears-FULL_SHARD-BACKWARD_POST-default]",
        why="the numbers never change (a prefetch only moves an all-gather); the common setup, an nn.Sequential of "
            "Linears under ModuleWrapPolicy (a root with no parameters), against torch FSDP1's recorded c10d "
            "order: each next unit's all-gather comes after this unit's reduce-scatter instead of before it",
    ),
    Fault(
        name="orig_params_frozen_at_wrap_stay_detached",
        plants="use_orig_params: a parameter's forward view is detached if it was frozen when wrapped (the slot's "
               "flag), so unfreezing it later gives it no gradient (torch never detaches a view)",
        target="minifsdp.fsdp.orig_params:OrigParams.use_unsharded_views",
        old="set_tensor_attr(slot.module, slot.name, v)",
        new="set_tensor_attr(slot.module, slot.name, v if slot.requires_grad else v.detach())",
        test="tests/test_fsdp_regimes_torch.py::"
             "test_requires_grad_changed_after_wrapping_trains_as_torch[linears-True-unfreeze]",
        why="progressive unfreezing: the first Linear's weight frozen before wrapping, unfrozen after a step; torch "
            "FSDP1 then gives it a gradient, reduces it and steps it, bitwise",
    ),
    Fault(
        name="lax_load_raises_on_missing_keys",
        plants="load_state_dict(strict=False) of a FULL / SHARDED state dict still raises on missing keys",
        target="minifsdp.fsdp.state_dict_type:load_full_state_dict",
        old="if strict and missing:",
        new="if missing:",
        test="tests/test_fsdp_regimes_torch.py::"
             "test_load_state_dict_of_wrong_dicts_as_torch[fsdp-FULL_STATE_DICT-False-missing_param]",
        why="an incomplete dict through an FSDP root, not strict: torch FSDP1 returns the missing key and loads the "
            "rest; the fault raises",
    ),
    Fault(
        name="fully_shard_bf16_summed_not_averaged",
        plants="fully_shard asks the collective for a sum, not avg, where nothing overflows (bf16, fp32): the "
               "gradients are never divided by the rank count",
        target="minifsdp.fsdp2.core.collectives:gradient_divide_factors",
        old="else (None, None, \"avg\", \"avg\")",
        new="else (None, None, \"sum\", \"sum\")",
        test="tests/test_fsdp2.py::test_half_precision_gradient_reduction_world_3[bf16_reduce_3]",
        why="3 ranks against torch FSDP2, bf16 reduce_dtype (the CI test's bf16 case): gradients 3x torch's and "
            "the collective's op differs.  (fp16's rule planted for bf16, /2 before the sum and /1.5 after, gave "
            "torch's bits here: /2 is exact)",
    ),
    # ------------------------------------------------------------------ the course's answers (chapter 1.3)
    Fault(
        name="sampler_no_padding",
        plants="task 1.3's answer cuts the data without padding it to a multiple of N: some ranks get one "
               "sample fewer, so they run one step fewer than the others",
        target="exercises.solutions.launch_tasks:rank_indices",
        old="order = (order * math.ceil(total / len(order)))[:total]",
        new="order = order[:total]",
        test="tests/exercises/test_launch_exercises.py::test_task1_3_slices_are_equal_in_length_and_cover_the_data",
        why="one process: 10 samples on 4 ranks must give every rank 3 (two of them padded), as torch's "
            "DistributedSampler does; unpadded, ranks 2 and 3 get 2",
    ),
    Fault(
        name="zero_bench_baseline_after_build",
        plants="the DeepSpeed bench takes its census baseline after building the trainer, so it counts only what the "
               "first step adds (the gradients and Adam's state), not the parameters",
        target="minifsdp.bench.zero:zero_rank",
        old="before = live_tensor_bytes()\n        trainer = build(name, copy.deepcopy(model), batch_size, "
            "bucket_elements)",
        new="trainer = build(name, copy.deepcopy(model), batch_size, bucket_elements)\n        "
            "before = live_tensor_bytes()",
        test="tests/test_bench_zero.py::test_the_census_after_a_step_is_fsdps_model_state_to_the_byte",
        why="2 ranks, the tiny GPT: FSDP's model state after a step is 16 bytes per sharded element plus the step "
            "tensors and buffers, exactly; without the shards built before the baseline the census falls short",
    ),
]


# A fault an exercise plants on purpose: every test the learner is given passes with it (checked by hand, the list of
# those tests in the exercise's text), and the learner writes the test that catches it.  Not in FAULTS: the test that
# catches it is the learner's (``test``), graded by tests/exercises (it passes unplanted and fails planted).
EXERCISE_FAULTS = [
    TASK_5_3_FAULT,
    # ------------------------------------------------------------------ the course's projects (exercises/projects)
    Fault(
        name="zero1_every_rank_updates_everything",
        plants="the ZeRO-1 reference gives every rank the whole flat range: each rank keeps optimizer state for, "
               "and updates, every parameter (the same numbers; N times the memory)",
        target="exercises.solutions.projects.zero1.zero1:Zero1.__init__",
        old="lo, hi = self.rank * self.shard, min((self.rank + 1) * self.shard, self.numel)",
        new="lo, hi = 0, self.numel",
        test="tests/exercises/projects/test_zero1.py::test_project_zero1_keeps_a_shard_of_the_optimizer_state[pair]",
        why="every rank computes the same update from the same averaged gradient, so losses and parameters stay "
            "bitwise torch's; only the census of what the optimizer keeps between steps (twice torch's fullest "
            "rank at 2 ranks) shows it",
    ),
    Fault(
        name="hybrid_all_reduce_before_reduce_scatter",
        plants="the HYBRID_SHARD reference all-reduces the whole gradient across replicas first, then "
               "reduce-scatters inside the shard group",
        target="exercises.solutions.projects.hybrid.hybrid:hybrid_reduce_gradient",
        old="ring_reduce_scatter(shard, grad, group=shard_group)\n    ring_all_reduce(shard, group=replicate_group)",
        new="ring_all_reduce(grad, group=replicate_group)\n    ring_reduce_scatter(shard, grad, group=shard_group)",
        test="tests/exercises/projects/test_hybrid.py::test_project_hybrid_shards_bitwise_torch_fsdp1[2x2-fp32]",
        why="the mean is the same in exact arithmetic, but fp32 sums (g0 + g2) + (g1 + g3) where torch sums "
            "(g0 + g1) + (g2 + g3): 2 x 2 ranks against torch FSDP1's shards (the byte count sees it too: the "
            "whole gradient crosses the replicas)",
    ),
    Fault(
        name="hybrid_divides_by_group_sizes",
        plants="the HYBRID_SHARD reference divides by the shard group's size before the sums and by the replicate "
               "group's after, not by torch's f and N / f",
        target="exercises.solutions.projects.hybrid.hybrid:hybrid_reduce_gradient",
        old="f = predivide_factor(n)",
        new="f = shard_size",
        test="tests/exercises/projects/test_hybrid.py::test_project_hybrid_shards_bitwise_torch_fsdp1[4x1-fp16]",
        why="at 2 x 2 the group sizes are torch's factors (2 and 2); in the 4 x 1 layout torch divides by 2 and 2, "
            "the fault by 4 and 1, and fp16 gradients near the smallest normal number round differently",
    ),
    Fault(
        name="accumulate_backward_outside_no_sync",
        plants="the accumulation reference runs each micro-batch's forward inside no_sync() and its backward "
               "outside it (the source's chapter 2.1 mistake)",
        target="exercises.solutions.projects.noshard_accum.accumulate:accumulate",
        old="loss = loss_fn(model, batch) / k_total\n            loss.backward()",
        new="loss = loss_fn(model, batch) / k_total\n        loss.backward()",
        test="tests/exercises/projects/test_noshard_accum.py::test_project_noshard_accum_predicts_the_bytes_sent"
             "[SHARD_GRAD_OP]",
        why="no_sync() decides in the backward whether to reduce: every micro-batch then reduce-scatters, so "
            "SHARD_GRAD_OP's second micro-batch sends its gradients instead of nothing, and count_bytes() no "
            "longer shows what the prediction (no_sync around both) says",
    ),
    Fault(
        name="ac_budget_reentrant_checkpoint",
        plants="the activation-checkpointing reference uses torch's reentrant checkpoint (use_reentrant=True)",
        target="exercises.solutions.projects.ac_budget.policy:apply_checkpointing",
        old="use_reentrant=False",
        new="use_reentrant=True",
        test="tests/exercises/projects/test_ac_budget.py::test_project_ac_budget_keeps_torch_gradients",
        why="the reentrant checkpoint runs its block under no_grad and builds a graph only from inputs that "
            "require grad: the first block's input is the batch, so its weights get no gradient at all, "
            "against torch's autograd on the plain model",
    ),
]


def by_name(name: str) -> Fault:
    for f in FAULTS + EXERCISE_FAULTS:
        if f.name == name:
            return f
    known = ", ".join(f.name for f in FAULTS + EXERCISE_FAULTS)
    raise KeyError(f"no planted fault named {name!r}; known: {known}")
