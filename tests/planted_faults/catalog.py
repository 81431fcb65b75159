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

__all__ = ["FAULTS", "by_name"]

GRADIENT = "minifsdp.fsdp.core.gradient"

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
        plants="FULL_SHARD keeps a unit's full parameters from its forward to its backward (as SHARD_GRAD_OP)",
        target="minifsdp.fsdp.core.fsdp:FullyShardedDataParallel._post_forward",
        old="self.sharding_strategy in RESHARD_AFTER_FORWARD",
        new="self.sharding_strategy is ShardingStrategy.HYBRID_SHARD",
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
    # ------------------------------------------------------------------ gradient averaging (chapter 2.1)
    Fault(
        name="divide_factor_post_forgotten",
        plants="each gradient is divided by f before the sum and the sum never by N / f",
        target=f"{GRADIENT}:UnitGradient.__init__",
        old="self.postdivide = dp / self.predivide",
        new="self.postdivide = 1.0",
        test="tests/test_fsdp_core.py::test_core_class_alone_is_bitwise_torch_fsdp1[3ranks-mlp]",
        why="at 2 ranks N / f = 1 and the fault is invisible; the core class alone at 3 ranks against torch FSDP1 "
            "(N / f = 1.5): gradients 1.5x, so losses and shards differ",
    ),
    Fault(
        name="fp16_divide_once_before_sum",
        plants="each gradient is divided by N once before the sum, not by f before and N / f after",
        target=f"{GRADIENT}:UnitGradient.__init__",
        old="self.predivide = predivide_factor(dp)",
        new="self.predivide = float(dp)",
        test="tests/test_mixed_precision.py::test_fp16_small_gradients_at_4_ranks_bitwise_vs_torch_fsdp1[FULL_SHARD]",
        why="exact in fp32 at 2 and 4 ranks (powers of two) and identical at 2 (f = N); fp16 at 4 ranks with "
            "gradients near fp16's smallest normal rounds differently from torch's /2, sum, /2",
    ),
    Fault(
        name="three_rank_divide_factors_swapped",
        plants="each gradient is divided by N / f before the sum and the sum by f (the two factors swapped)",
        target=f"{GRADIENT}:UnitGradient.__init__",
        old="self.predivide = predivide_factor(dp)",
        new="self.predivide = dp / predivide_factor(dp)",
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
        old="h.layout.padded_numel, h.dtypes.reduce, self.predivide",
        new="h.layout.padded_numel, h.dtypes.param, self.predivide",
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
        target="minifsdp.fsdp.core.full_params:clip_grad_norm_",
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
        target="minifsdp.fsdp.param_pieces:holders",
        old="layout.shard_range(h.groups.shard_rank if h.sharded else 0)",
        new="layout.shard_range(dist.get_rank() if h.sharded else 0)",
        test="tests/test_checkpoint.py::test_sharded_save_at_hybrid_layout_keys_pieces_by_shard_rank",
        why="the two ranks coincide at 2 ranks and in the first replica; HYBRID_SHARD with shard groups {0, 1}, "
            "{2, 3} is the smallest layout where global rank 2 is shard rank 0",
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
        target="minifsdp.fsdp2.param:copy_out_group",
        old="torch.split_with_sizes_copy(gathered, numels, dim=1, out=outs)",
        new="[o.copy_(gathered[:, :n]) for o, n in zip(outs, numels)]",
        test="tests/test_fsdp2.py::test_parity_with_torch_fsdp2_world_3",
        why="the smallest fully_shard spawn against torch FSDP2 (3 ranks, 2 cases, 2 steps), with odd widths "
            "whose shards are uneven and padded",
    ),
    Fault(
        name="orig_params_write_back_skipped",
        plants="use_orig_params: a parameter given new storage between steps is re-pointed at the shard without "
               "its numbers being copied in, so the user's change is silently lost",
        target="minifsdp.fsdp.orig_params:OrigParamHandle.write_back_originals",
        old='flat.data[lo:hi].copy_(_checked(now.detach(), hi - lo, self.sharded, slot.fqn, "parameter"))',
        new='_checked(now.detach(), hi - lo, self.sharded, slot.fqn, "parameter")',
        test="tests/test_torch_api_more.py::test_use_orig_params_writes_back_what_the_user_changed_as_torch"
             "[FULL_SHARD-data-2]",
        why="2 ranks, a weight's .data replaced after a step, against torch FSDP1: the next losses and the full "
            "parameters differ",
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
    ),
]


def by_name(name: str) -> Fault:
    for f in FAULTS:
        if f.name == name:
            return f
    raise KeyError(f"no planted fault named {name!r}; known: {', '.join(f.name for f in FAULTS)}")
