"""MixedPrecision and ShardedGradScaler against torch FSDP1, bitwise.

Oracle: torch FSDP1 ``FullyShardedDataParallel(mixed_precision=torch's MixedPrecision(...))``
with the same nested wrapping, model, data and optimizer, 2 ranks, 4 AdamW steps.
Tolerance: BITWISE (losses, each rank's fp32 flat shards, full parameters) for
bf16 and fp16, FULL_SHARD and SHARD_GRAD_OP, reduce in param_dtype or fp32,
use_orig_params: we perform the same casts in the same order (cast the fp32
shard, all-gather in param_dtype, cast the gradient to reduce_dtype, pad,
pre-divide, reduce-scatter, post-divide, cast to fp32) with the same gloo
collectives, so every rounding happens at the same place.

The ShardedGradScaler oracle is torch's ``torch.distributed.fsdp.sharded_grad_scaler.
ShardedGradScaler(device="cpu")``, fp16, an inf injected into rank 1's gradient shard
only: bitwise parameters, the same scale sequence, and both ranks skip that step.

Two regimes at the end, each bitwise against torch FSDP1 on the MLP, SGD with momentum
(``tests/_workers_mixed_precision.py``): NO_SHARD with a bf16 ``param_dtype`` accumulating two
backwards (inside ``no_sync``, or with no ``zero_grad`` between steps), 2 ranks; and fp16 compute
and reduce at 4 ranks with the loss times 1e-4, where torch's split of the average (divide by 2
before the sum, by 2 after) rounds small fp16 gradients differently from one divide by 4.
"""

import numpy as np
import pytest

import minifsdp
from minifsdp.fsdp import MixedPrecision, ShardedGradScaler
from minifsdp.fsdp.core.mixed_precision import resolve_dtypes
from tests import _workers_mixed_precision as R
from tests import _workers_overlap as W
from tests._workers_fsdp import assert_bitwise, assert_same_training, full_items, pairs

CASES = [(name, s) for name in W.MP_CASES for s in ("FULL_SHARD", "SHARD_GRAD_OP")] + [("bf16", "orig_params")]


@pytest.fixture(scope="module")
def runs():
    return minifsdp.spawn(W.mixed_precision_worker, world_size=2, timeout_s=240)


def _bitwise(ours, theirs, what):
    """Bitwise torch FSDP1's training (``assert_same_training``), its shards and full parameters in fp32."""
    assert all(a.dtype == np.float32 for a in ours["shards"])  # fp32 master shards
    for name, a, _ in full_items(ours["full"], theirs["full"]):
        assert a.dtype == np.float32, name  # state dict in full precision, as torch
    assert_same_training(ours, theirs, what)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("case", CASES, ids=["-".join(c) for c in CASES])
def test_bitwise_vs_torch_fsdp1_mixed_precision(runs, case):
    for rank, res in enumerate(runs):
        _bitwise(res[case]["ours"], res[case]["torch"], f"rank {rank} {case}")


def test_low_precision_really_used(runs):
    """The forward sees param_dtype weights, the optimizer fp32 grads, and the losses differ from fp32's."""
    for res in runs:
        for name, mp in W.MP_CASES.items():
            ours = res[(name, "FULL_SHARD")]["ours"]
            assert set(ours["compute_dtypes"]) == {str(mp.param_dtype)}
            assert all(d == ["torch.float32"] for d in ours["grad_dtypes"])
            assert ours["losses"] != res["fp32_losses"]
            np.testing.assert_allclose(ours["losses"], res["fp32_losses"], rtol=0.02)  # bf16: ~3 digits
        assert res["buffer_dtype"] == "torch.bfloat16"
        assert res["input_dtype"] == "torch.bfloat16"  # cast_root_forward_inputs


def test_autocast_and_mixed_precision_differ(runs):
    """torch.amp.autocast picks a dtype per op and keeps fp32 weights (a LayerNorm stays fp32);
    FSDP's MixedPrecision casts the parameters, so every op of the unit runs in bf16."""
    for res in runs:
        seen = res["autocast_vs_mp"]
        assert seen["autocast/LayerNorm"] == ("torch.float32", "torch.float32")
        assert seen["autocast/Linear"] == ("torch.bfloat16", "torch.float32")
        assert seen["fsdp_mp/LayerNorm"] == ("torch.bfloat16", "torch.bfloat16")
        assert seen["fsdp_mp/Linear"] == ("torch.bfloat16", "torch.bfloat16")


def test_sharded_grad_scaler_skips_on_every_rank(runs):
    ours = [r["scaler"]["ours"] for r in runs]
    theirs = [r["scaler"]["torch"] for r in runs]
    for rank, (o, t) in enumerate(pairs(ours, theirs)):
        _bitwise(o, t, f"rank {rank} scaler")
        assert o["scales"] == t["scales"]
        assert o["stepped"] == t["stepped"] == [True, False, True, True]  # the inf was on rank 1 only
    assert ours[0]["scales"] == [1024.0, 512.0, 512.0, 1024.0]  # back off, then grow after 2 good steps


def test_bad_arguments():
    import torch

    with pytest.raises(ValueError, match="floating dtype"):
        MixedPrecision(param_dtype=torch.int8)
    MixedPrecision(param_dtype=torch.bfloat16, keep_low_precision_grads=True)  # implemented: tests/test_torch_api.py
    with pytest.raises(ValueError, match="backoff_factor"):
        ShardedGradScaler(backoff_factor=2.0)
    d = resolve_dtypes(MixedPrecision(param_dtype=torch.float16), torch.float32)
    assert (d.param, d.reduce) == (torch.float16, torch.float16)
    d = resolve_dtypes(MixedPrecision(reduce_dtype=torch.bfloat16), torch.float32)
    assert (d.param, d.reduce) == (torch.float32, torch.bfloat16)


# ---------------------------------------------------------------- regimes: accumulation, fp16 averaging at 4 ranks
@pytest.fixture(scope="module")
def accumulation():
    return minifsdp.spawn(R.no_shard_accumulation_worker, world_size=2, timeout_s=240)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("orig", [False, True], ids=["flat_grads", "orig_param_grads"])
@pytest.mark.parametrize("schedule", ["no_sync", "no_zero_grad"])
def test_no_shard_bf16_gradient_accumulation_bitwise_vs_torch_fsdp1(accumulation, schedule, orig):
    """NO_SHARD + ``MixedPrecision(param_dtype=bf16)``, 2 ranks, the MLP: two backwards that accumulate, either
    the first inside ``no_sync()`` and the second synced, or one per step with no ``zero_grad`` between steps.

    There torch's flat parameter is the bf16 leaf while the backward runs, so its AccumulateGrad adds the new
    bf16 gradient into ``flat_param.grad`` (bf16 after a no_sync backward, fp32 after a synced one) before the
    all-reduce; we keep our leaf apart and must add by the same rule.  Oracle: torch FSDP1, same model, seed,
    data, SGD with momentum.  Bitwise: after every backward each gradient's dtype and numbers (the flat
    gradient, ``use_orig_params=False``; each original parameter's, ``use_orig_params=True``), after every step
    the parameters, and the losses.
    """
    for rank, res in enumerate(accumulation):
        rec = res[(schedule, orig)]
        assert_bitwise(rec["ours"], rec["torch"], f"rank {rank}")
        dtypes = {d for g in rec["torch"]["grads"] for d, _ in g.values()}
        if schedule == "no_sync" and not orig:  # the no_sync gradient is torch's bf16 leaf's, the synced one fp32
            assert dtypes == {"torch.bfloat16", "torch.float32"}, dtypes
        assert all(v is not None and np.any(v) for g in rec["torch"]["grads"] for _, v in g.values())


@pytest.fixture(scope="module")
def fp16_four_ranks():
    return minifsdp.spawn(R.fp16_small_grads_worker, args=(["FULL_SHARD", "NO_SHARD"],), world_size=4, timeout_s=240)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("strategy", ["FULL_SHARD", "NO_SHARD"])
def test_fp16_small_gradients_at_4_ranks_bitwise_vs_torch_fsdp1(fp16_four_ranks, strategy):
    """``MixedPrecision(param_dtype=fp16, reduce_dtype=fp16)`` at 4 ranks with the loss times 1e-4: gradients
    near fp16's smallest normal number, reduced in fp16.

    torch divides each rank's gradient by f = 2 before the sum and the sum by N / f = 2 after; dividing by 4
    once, before, rounds small fp16 numbers differently (at 2 ranks f = N, so only 4 ranks tell the two apart,
    and in fp32 both are exact).  Oracle: torch FSDP1, same model, seed and data.  Bitwise: every gradient the
    optimizer reads (each rank's fp32 flat shard, or the whole flat gradient under NO_SHARD), the parameters
    after each SGD step, the losses.
    """
    for rank, res in enumerate(fp16_four_ranks):
        rec = res[strategy]
        assert_bitwise(rec["ours"], rec["torch"], f"rank {rank}")
        numbers = np.concatenate([v for g in rec["torch"]["grads"] for _, v in g.values() if v is not None])
        small = (numbers != 0) & (np.abs(numbers) < 2.0 ** -10)
        assert small.mean() > 0.5, "the gradients must be small for fp16 rounding to matter"


def test_input_cast_walks_the_nest_as_torch_does():
    """The inputs' cast, against torch's own (``torch.distributed.utils._cast_forward_inputs``, what FSDP1's root
    and FSDP2's ``fully_shard`` call): floating tensors inside tuples, lists, dicts, namedtuples and dataclasses
    become ``param_dtype``; integer tensors and non-tensors stay.  Exact: a cast is a cast."""
    import collections
    import dataclasses

    import torch
    from torch.distributed.utils import _cast_forward_inputs

    from minifsdp.fsdp.core.mixed_precision import cast_floating

    @dataclasses.dataclass
    class Batch:
        x: torch.Tensor
        ids: torch.Tensor
        note: str

    Pair = collections.namedtuple("Pair", "a b")
    args = (torch.randn(2, 3), [torch.randn(2), 7], Pair(torch.randn(1), torch.arange(3)),
            {"mask": torch.ones(2, dtype=torch.bool), "h": torch.randn(4)}, Batch(torch.randn(3), torch.arange(2), "n"))
    ours = cast_floating(args, torch.bfloat16)
    theirs, _ = _cast_forward_inputs(torch.bfloat16, *args)
    flat_ours, flat_theirs = [], []
    for tree, flat in ((ours, flat_ours), (theirs, flat_theirs)):
        torch.distributed.utils._apply_to_tensors(lambda t, flat=flat: flat.append(t) or t, tree)
    assert len(flat_ours) == len(flat_theirs) == 8
    for a, b in zip(flat_ours, flat_theirs):
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert ours[4].x.dtype == torch.bfloat16 and ours[4].ids.dtype == torch.int64 and ours[4].note == "n"
    assert isinstance(ours[2], Pair) and ours[1][1] == 7 and cast_floating(args, None) is args
