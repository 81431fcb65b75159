"""Chapter 4.4: FSDP composed with tensor parallelism (2-D) and with pipeline parallelism, at 4 ranks on gloo.

One spawn (``tests/_workers_2d.py``, module-scoped, 4 ranks) runs every case; the tests read its results.

FSDP x TP on ``init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))``: TinyGPT with every block's
attention (qkv colwise by heads, proj rowwise) and MLP split by our ``parallelize_module`` on ``mesh["tp"]``,
then our ``FullyShardedDataParallel`` over ``mesh["dp"].get_group()``, one unit per ``Block``.  Oracles:

* one process training the plain TinyGPT on the whole batch (both dp groups' rows), 3 steps of SGD with
  momentum: losses and the full parameters after the steps within TOL_2D = 1e-5, not bitwise, because a
  row-parallel layer sums each dot product in two halves (one per tp rank) that the all-reduce then adds:
  another summation order than the single process's.  Measured: losses 4.8e-7, parameters 7.5e-8.
  Why SGD and not AdamW here: a key's bias has an analytically zero gradient (softmax ignores a shift that
  is the same for every key), so both runs see only rounding noise there (~1e-10, different in each), and
  Adam divides by its own magnitude: the noise becomes steps of up to ~lr * 1e-2.  Measured with AdamW
  (lr 1e-2, 3 steps): every parameter within 1.9e-7 except 30 of the 96 ``attn.qkv.bias`` entries (all in
  the key third), off by up to 2.5e-5.  The MLP below has no such parameter and uses AdamW.
* our per-parameter ``minifsdp.fsdp2.fully_shard(mesh=mesh["dp"])`` (each Block, then the root) in place of
  our FSDP1-style wrapper, the same TP plan and steps: within TOL_2D of the one process, and bitwise equal to
  the FSDP1-style run (both reduce the same per-rank gradients over 2 dp ranks: a + b in either order is the
  same float, and / 2 is exact; the TP arithmetic is the same code).
* torch's own 2-D: ``torch.distributed.tensor.parallel.parallelize_module`` then ``fully_shard(mesh=mesh["dp"])``
  (FSDP2 over DTensor), on ``MLP((16, 32, 32, 8))`` with net.2 colwise / net.4 rowwise (torch's plan cannot
  split TinyGPT's fused qkv by heads), 3 AdamW steps: within TOL_TORCH = 1e-6 (our row-parallel bias is
  added after the all-reduce, torch's DTensor adds b/2 on each rank before it; see test_tensor_parallel.py).
  Measured: losses bitwise, parameters 1.5e-8.
* the faults, each must miss the single process: both dp groups read the same rows (each tp pair still
  agreeing); our FSDP's reduce-scatter replaced by "keep my own rows of my own gradient" (no dp reduction).
  Measured: losses off by 2.0e-2 and 1.6e-2, parameters by 0.29 and 0.23 (the tests ask for > 100 x TOL_2D).

FSDP x PP (the source's DeepSpeed "ZeRO-3 + pipeline" config): two pipeline stages (our ``PipelineStage`` +
``ScheduleGPipe`` over ``mesh["pp"]``), each an ``MLP`` wrapped by our FSDP with one unit per Linear (U = 2
units per stage) over its dp group, M micro-batches, one SGD step.  Each run equals one process on the whole
batch (within 1e-6: micro-batch gradients are summed then divided by M; measured 1.5e-8).  The collectives
FSDP issued per optimizer step are *counted* (``count_fsdp_collectives`` wraps our FSDP's ``Comm``) and
compared with the formula, for FULL_SHARD (ZeRO-3), SHARD_GRAD_OP (ZeRO-2) and NO_SHARD (DDP-like; ZeRO-1 moves
the same gradient bytes), each with a reduction per micro-batch (as the schedule runs them) and with
``no_sync()`` on every micro-batch's backward but the last (gradients accumulated unreduced):

    strategy         all-gathers / step        reductions / step   with no_sync(): AG / reductions
    FULL_SHARD       2 U M  (F and B each)     U M  reduce-scatter  2 U M / U    (params are still resharded)
    SHARD_GRAD_OP    U M    (F0, then B1..)    U M  reduce-scatter  U     / U    (but full params and grads held)
    NO_SHARD         0                         U M  all-reduce      0     / U

ZeRO-3's all-gathers grow with M whatever one does, and ZeRO-2's reduce-scatters grow with M unless the whole
gradient is kept unsharded between micro-batches (which is what ZeRO-2 exists to avoid): the reason DeepSpeed's
pipeline engine accepts only ZeRO stage 0 or 1.
"""

from __future__ import annotations

import math

import pytest
import torch

from minifsdp.launch import spawn
from tests import _workers_2d as W

TOL_2D = 1e-5
TOL_TORCH = 1e-6
TOL_PP = 1e-6
WORLD = 4


@pytest.fixture(scope="module")
def res():
    return spawn(W.two_d_worker, world_size=WORLD, timeout_s=300)


def _max_diff(a: dict, b: dict, what: str) -> float:
    """The largest elementwise difference over two dicts of tensors with the same keys and shapes."""
    assert sorted(a) == sorted(b) and len(a) > 0, f"{what}: keys {sorted(a)} vs {sorted(b)}"
    for k in a:
        assert a[k].shape == b[k].shape and a[k].dtype == b[k].dtype, f"{what}[{k}]: {a[k].shape} vs {b[k].shape}"
    return max((a[k] - b[k]).abs().max().item() for k in a)


def _loss_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape == (W.STEPS,), f"{a.shape} vs {b.shape}"
    return (a - b).abs().max().item()


# ----------------------------------------------------------------------------- FSDP x TP
def test_ranks_sit_on_a_2x2_mesh(res):
    assert [r["coord"] for r in res] == [(0, 0), (0, 1), (1, 0), (1, 1)]


def test_each_rank_holds_a_tp_slice_sharded_again_by_fsdp(res):
    ref = res[0]["gpt"]["ref_params"]
    for r in res:
        shapes = r["gpt"]["local_shapes"]
        assert shapes["blocks.0.attn.qkv.weight"] == (48, 32)  # 3 x 32 rows, half of each of q, k, v
        assert shapes["blocks.0.attn.proj.weight"] == (32, 16)
        assert shapes["blocks.1.mlp.0.weight"] == (64, 32) and shapes["blocks.1.mlp.2.weight"] == (32, 64)
        tp_numel = sum(math.prod(s) for s in shapes.values())
        assert tp_numel < sum(p.numel() for p in ref.values())
        flat = r["gpt"]["flat_numel"]  # our FSDP's local shards: the TP slices halved again over dp (+ padding)
        assert len(flat) == 3 and tp_numel / 2 <= sum(flat) <= tp_numel / 2 + len(flat), (flat, tp_numel)


def test_fsdp_x_tp_losses_equal_one_process(res):
    ref = res[0]["gpt"]["ref_losses"]
    for rank, r in enumerate(res):
        d = _loss_diff(r["gpt"]["losses"], ref)
        assert d <= TOL_2D, f"rank {rank}: loss differs by {d:.3g}"


def test_fsdp_x_tp_parameters_equal_one_process(res):
    ref = res[0]["gpt"]["ref_params"]
    for rank, r in enumerate(res):
        d = _max_diff(r["gpt"]["params"], ref, f"rank {rank} full parameters")
        assert d <= TOL_2D, f"rank {rank}: parameters differ by {d:.3g} after {W.STEPS} steps"
        assert not torch.equal(r["gpt"]["params"]["tok_emb.weight"], W.TinyGPT(W.GPTConfig.tiny()).tok_emb.weight)


def test_fault_no_dp_reduction_is_caught(res):
    ref = res[0]["gpt"]
    for rank, r in enumerate(res):
        bad = r["gpt_no_dp_reduction"]
        assert bad["losses"][0] == r["gpt"]["losses"][0], rank  # the first loss is before any update
        assert _loss_diff(bad["losses"], ref["ref_losses"]) > 100 * TOL_2D, rank
        assert _max_diff(bad["params"], ref["ref_params"], "fault") > 100 * TOL_2D, rank


def test_per_parameter_fully_shard_x_tp_equals_one_process_and_fsdp1(res):
    ref = res[0]["gpt"]
    for rank, r in enumerate(res):
        two = r["gpt_fsdp2"]
        assert _loss_diff(two["losses"], ref["ref_losses"]) <= TOL_2D, rank
        assert _max_diff(two["params"], ref["ref_params"], f"rank {rank} fsdp2 x tp vs one process") <= TOL_2D
        assert _loss_diff(two["losses"], r["gpt"]["losses"]) == 0, rank
        assert _max_diff(two["params"], r["gpt"]["params"], f"rank {rank} fsdp2 x tp vs fsdp1 x tp") == 0


def test_fault_same_rows_on_both_dp_groups_is_caught(res):
    ref = res[0]["gpt"]
    for rank, r in enumerate(res):
        assert _loss_diff(r["gpt_same_rows"]["losses"], ref["ref_losses"]) > 100 * TOL_2D, rank
        assert _max_diff(r["gpt_same_rows"]["params"], ref["ref_params"], "fault") > 100 * TOL_2D, rank


def test_ours_equals_torch_fsdp2_x_tp_on_the_mlp(res):
    ref = res[0]["mlp_torch"]["ref"]
    for rank, r in enumerate(res):
        ours, theirs = r["mlp_torch"]["ours"], r["mlp_torch"]["torch"]
        assert _loss_diff(ours["losses"], theirs["losses"]) <= TOL_TORCH, rank
        assert _max_diff(ours["params"], theirs["params"], f"rank {rank} ours vs torch") <= TOL_TORCH
        assert _loss_diff(ours["losses"], ref["losses"]) <= TOL_2D, rank
        assert _max_diff(ours["params"], ref["params"], f"rank {rank} ours vs one process") <= TOL_2D


# ----------------------------------------------------------------------------- FSDP x PP
def _pp(res, rank: int, strategy: str, accumulate: bool, m: int) -> dict:
    return res[rank]["pp"][(strategy, accumulate, m)]


def _formula(strategy: str, accumulate: bool, units: int, m: int) -> dict[str, int]:
    """The collectives per optimizer step the table in this module's docstring predicts."""
    reductions = units if accumulate else units * m
    if strategy == "FULL_SHARD":
        return {"all_gather": 2 * units * m, "reduce_scatter": reductions}
    if strategy == "SHARD_GRAD_OP":
        return {"all_gather": units if accumulate else units * m, "reduce_scatter": reductions}
    return {"all_reduce": reductions}


CASES = [(st, acc, m) for st in W.STRATEGIES for acc in (False, True) for m in W.MICROBATCHES]


def test_pipeline_with_fsdp_stages_equals_one_process(res):
    ref = res[0]["pp"]["ref"]
    for st, acc, m in CASES:
        for rank in range(WORLD):
            c = _pp(res, rank, st, acc, m)
            stage = rank // 2
            assert c["actions"] == [f"F{i}" for i in range(m)] + [f"B{i}" for i in range(m)]  # GPipe
            mine = {k: v for k, v in ref.items() if k.startswith(f"{stage}.")}
            d = _max_diff(c["params"], mine, f"{st} no_sync={acc} M={m} rank {rank}")
            assert d <= TOL_PP, f"{st} no_sync={acc} M={m} rank {rank}: {d:.3g}"


@pytest.mark.parametrize("strategy", W.STRATEGIES)
def test_collectives_per_step_match_the_formula(res, strategy):
    for acc in (False, True):
        for m in W.MICROBATCHES:
            for rank in range(WORLD):
                c = _pp(res, rank, strategy, acc, m)
                assert c["units"] == 2
                assert c["counts"] == _formula(strategy, acc, c["units"], m), (strategy, acc, m, rank, c["log"])
                per_action = {}  # the log, summed, is the step's total
                for _, delta in c["log"]:
                    for k, v in delta.items():
                        per_action[k] = per_action.get(k, 0) + v
                assert per_action == c["counts"]


def test_zero3_collectives_grow_with_microbatches_ddp_like_do_not(res):
    """The counts themselves (not the formula) against M: what makes ZeRO-2/3 a poor fit for a pipeline."""
    def total(st, acc, m):
        return sum(_pp(res, 0, st, acc, m)["counts"].values())
    ms = W.MICROBATCHES
    assert [total("FULL_SHARD", False, m) for m in ms] == [6 * m for m in ms]  # 2 units x (2 AG + 1 RS)
    assert [total("FULL_SHARD", True, m) for m in ms] == [4 * m + 2 for m in ms]  # no_sync cannot save the AGs
    assert [total("NO_SHARD", True, m) for m in ms] == [2, 2, 2]  # DDP / ZeRO-1: one reduction per step
    # the check catches the difference it exists for: the per-micro-batch reductions are counted
    assert total("NO_SHARD", False, 4) == 4 * total("NO_SHARD", True, 4)


def test_each_microbatch_forward_all_gathers_under_zero3(res):
    log = _pp(res, 0, "FULL_SHARD", False, 4)["log"]
    assert [a for a, _ in log] == ["F0", "F1", "F2", "F3", "B0", "B1", "B2", "B3"]
    assert all(d.get("all_gather") == 2 for _, d in log)
    assert [d.get("reduce_scatter", 0) for _, d in log] == [0, 0, 0, 0, 2, 2, 2, 2]
    zero2 = _pp(res, 0, "SHARD_GRAD_OP", False, 4)["log"]  # kept after F0; each post-backward frees it
    assert [d.get("all_gather", 0) for _, d in zero2] == [2, 0, 0, 0, 0, 2, 2, 2]
