"""Chapter 4.4: tensor parallelism (minifsdp.parallel.tensor_parallel) against torch's own, at 2 ranks on gloo.

One spawn (``tests/_workers_tp.py``, module-scoped) runs every case; the tests read its results.

Oracles and tolerances:

* torch's ``torch.distributed.tensor.parallel.parallelize_module`` with the same plan on
  ``init_device_mesh("cpu", (2,))``, on ``MLP((16, 32, 32, 8))`` with ``net.2`` colwise and ``net.4`` rowwise
  (``net.0`` stays whole, so the backward all-reduce of ``net.2``'s input matters for its gradient):
  - local slices: bitwise (the same cut);
  - outputs, local gradients, two SGD / AdamW steps: within TORCH_TOL, not bitwise, for one reason:
    the row-parallel bias.  We add it once after the all-reduce (Megatron's order); torch's DTensor turns
    the replicated bias into a partial one (b / 2 on each rank) and adds it before the all-reduce, so the
    floats are added in another order (redone by hand, that order is torch's output bitwise).
    Measured: 3e-8 (outputs), 4e-9 (gradients), 1.5e-8 (AdamW steps).
    With that bias zeroed, outputs and gradients are bitwise equal (``test_zero_row_bias_is_bitwise``).
* the unsharded model in one process: within REF_TOL.  A row-parallel layer sums each dot product as two
  halves (one per rank) and then adds the halves: another summation order.  Measured at most 6.4e-8
  (the whole tiny GPT's gradients).
* collectives counted by torch's ``CommDebugMode`` on both sides: one all-reduce per forward, one per
  backward, for each colwise/rowwise pair.
"""

import pytest
import torch

from minifsdp.launch import spawn
from minifsdp.models import MLP
from minifsdp.parallel.tensor_parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from tests import _workers_tp as W

WORLD = 2
TORCH_TOL = 1e-6
REF_TOL = 1e-6
SHARDED_MLP = {"net.2.weight": (16, 32), "net.2.bias": (16,), "net.4.weight": (8, 16), "net.4.bias": (8,)}


@pytest.fixture(scope="module")
def res():
    return spawn(W.tp_worker, world_size=WORLD, timeout_s=300)


def _close(a: dict | torch.Tensor, b: dict | torch.Tensor, tol: float, what: str) -> None:
    """Equal within ``tol`` (0: bitwise), key by key; shapes and key sets must match."""
    if isinstance(a, dict):
        assert sorted(a) == sorted(b) and len(a) > 0, f"{what}: keys {sorted(a)} vs {sorted(b)}"
        for k in a:
            _close(a[k], b[k], tol, f"{what}[{k}]")
        return
    assert a.dtype == b.dtype and a.shape == b.shape, f"{what}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
    if tol == 0:
        assert torch.equal(a, b), f"{what}: not bitwise equal, max diff {(a - b).abs().max().item():.3g}"
    else:
        diff = (a - b).abs().max().item()
        assert diff <= tol, f"{what}: max diff {diff:.3g} > {tol}"


# ----------------------------------------------------------------------------- the MLP against torch
def test_local_slices_equal_torch_to_local(res):
    for rank, r in enumerate(res):
        c = r["mlp"]
        _close(c["init_ours"], c["init_torch"], 0, f"rank {rank} local parameters vs torch's .to_local()")
        for name, shape in SHARDED_MLP.items():
            assert tuple(c["init_ours"][name].shape) == shape, f"{name} on rank {rank}"


def test_full_tensor_reassembles_the_unsharded_weights(res):
    base = dict(MLP(W.MLP_DIMS, seed=0).named_parameters())
    for r in res:
        _close(r["mlp"]["full_param_ours"], {n: p.detach() for n, p in base.items()}, 0, "full_tensor(p)")
    # rank 0 holds the first half of net.2's rows, rank 1 the second (Shard(0)); net.4's columns (Shard(1))
    _close(res[0]["mlp"]["init_ours"]["net.2.weight"], base["net.2.weight"].detach()[:16], 0, "rank 0 rows")
    _close(res[1]["mlp"]["init_ours"]["net.4.weight"], base["net.4.weight"].detach()[:, 16:], 0, "rank 1 columns")


def test_outputs_and_local_gradients_equal_torch(res):
    for rank, r in enumerate(res):
        c = r["mlp"]
        _close(c["ours"]["out"], c["torch"]["out"], TORCH_TOL, f"rank {rank} output")
        _close(c["grad_ours"], c["grad_torch"], TORCH_TOL, f"rank {rank} local gradients")
    _close(res[0]["mlp"]["ours"]["out"], res[1]["mlp"]["ours"]["out"], 0, "output replicated on both ranks")


def test_zero_row_bias_is_bitwise(res):
    """The only difference from torch is where the row-parallel bias is added: without it, bitwise."""
    for rank, r in enumerate(res):
        c = r["mlp_zero_bias"]
        _close(c["ours"]["out"], c["torch"]["out"], 0, f"rank {rank} output, zero bias")
        _close(c["grad_ours"], c["grad_torch"], 0, f"rank {rank} local gradients, zero bias")
    assert not torch.equal(res[0]["mlp"]["ours"]["out"], res[0]["mlp"]["torch"]["out"]), \
        "with the bias, the orders differ (else this test's reason is wrong and TORCH_TOL could be 0)"


def test_torch_adds_the_row_bias_split_before_the_all_reduce(res):
    """The reason above, checked: all-reduce(y_r W_r^T + b / 2), redone by hand, is torch's output bitwise."""
    for rank, r in enumerate(res):
        c = r["mlp"]
        _close(c["torch_order_out"], c["torch"]["out"], 0, f"rank {rank} b / N before the all-reduce vs torch")


def test_process_group_works_as_the_mesh(res):
    for r in res:
        _close(r["mlp_group"]["ours"]["out"], r["mlp"]["ours"]["out"], 0, "ProcessGroup vs DeviceMesh output")
        _close(r["mlp_group"]["grad_ours"], r["mlp"]["grad_ours"], 0, "ProcessGroup vs DeviceMesh gradients")


@pytest.mark.parametrize("optim", ["sgd", "adamw"])
def test_two_optimizer_steps_equal_torch(res, optim):
    for rank, r in enumerate(res):
        c = r[optim]
        _close(c["step_ours"], c["step_torch"], TORCH_TOL, f"rank {rank} {optim} parameters after 2 steps")
        assert not torch.equal(c["step_ours"]["net.2.weight"], c["init_ours"]["net.2.weight"]), "no step taken"


def test_gradients_equal_the_unsharded_model(res):
    for rank, r in enumerate(res):
        c = r["mlp"]
        _close(c["ours"]["out"], c["ref"]["out"], REF_TOL, f"rank {rank} output vs unsharded")
        _close(c["full_grad_ours"], c["ref"]["grad"], REF_TOL, f"rank {rank} gathered gradients vs unsharded")


# ----------------------------------------------------------------------------- collectives and faults
def test_one_all_reduce_forward_one_backward_as_torch(res):
    for r in res:
        c = r["mlp"]
        assert (c["ours"]["fwd"], c["ours"]["bwd"]) == ({"allreduce_": 1}, {"allreduce_": 1})
        assert (c["torch"]["fwd"], c["torch"]["bwd"]) == ({"all_reduce": 1}, {"all_reduce": 1})  # torch's, counted
        # the tiny GPT: 2 blocks x (attention + MLP) = 4 colwise/rowwise pairs
        assert (r["gpt"]["fwd"], r["gpt"]["bwd"]) == ({"allreduce_": 4}, {"allreduce_": 4})


def test_ring_collectives_same_numbers_and_bytes_counted(res):
    """collectives="ring": our ring all-reduce from minifsdp.comm; at 2 ranks a + b == b + a, so bitwise the same.

    Bytes per rank, ring all-reduce of S bytes at N ranks: 2(N-1)/N x S sent.  Forward: the row-parallel
    output (4, 8) fp32 = 128 B; backward: the column-parallel input's gradient (4, 32) fp32 = 512 B.
    """
    n = WORLD
    for r in res:
        ring, gloo = r["mlp_ring"], r["mlp"]
        _close(ring["ours"]["out"], gloo["ours"]["out"], 0, "ring vs gloo output")
        _close(ring["grad_ours"], gloo["grad_ours"], 0, "ring vs gloo gradients")
        assert ring["ours"]["fwd_bytes"][:2] == (2 * (n - 1) * 4 * 8 * 4 // n,) * 2
        assert ring["ours"]["bwd_bytes"][:2] == (2 * (n - 1) * 4 * 32 * 4 // n,) * 2
        assert gloo["ours"]["fwd_bytes"] == (0, 0, 0), "gloo's all-reduce is not ours to count"


def test_skipping_the_backward_all_reduce_is_caught(res):
    """f without its all-reduce: the output is unchanged, but net.0 (before the colwise layer) gets a wrong grad."""
    for r in res:
        c = r["fault_bwd"]
        assert c["ours"]["bwd"] == {}, "the fault removes the backward all-reduce"
        _close(c["ours"]["out"], c["torch"]["out"], TORCH_TOL, "output (the forward is untouched)")
        _close({k: v for k, v in c["grad_ours"].items() if k != "net.0.weight" and k != "net.0.bias"},
               {k: v for k, v in c["grad_torch"].items() if k != "net.0.weight" and k != "net.0.bias"},
               TORCH_TOL, "gradients after the colwise layer")
        with pytest.raises(AssertionError, match=r"net\.0\."):
            _close(c["grad_ours"], c["grad_torch"], TORCH_TOL, "gradients")


def test_skipping_the_forward_all_reduce_is_caught(res):
    for r in res:
        c = r["fault_fwd"]
        assert c["ours"]["fwd"] == {}
        with pytest.raises(AssertionError, match="output"):
            _close(c["ours"]["out"], c["torch"]["out"], TORCH_TOL, "output")


# ----------------------------------------------------------------------------- attention and the whole GPT
def test_attention_split_by_heads_equals_the_unsharded_attention(res):
    """qkv = ColwiseParallel(chunks=3): rank r holds [q_r; k_r; v_r], its own heads; proj is row-parallel."""
    for rank, r in enumerate(res):
        a = r["attn"]
        heads, ref = a["ours_heads"], a["ref"]
        _close(heads["out"], ref["out"], REF_TOL, f"rank {rank} attention output")
        _close(heads["x_grad"], ref["x_grad"], REF_TOL, f"rank {rank} input gradient")
        _close(heads["full_grad"], ref["grad"], REF_TOL, f"rank {rank} gathered gradients")
        assert (heads["fwd"], heads["bwd"]) == ({"allreduce_": 1}, {"allreduce_": 1})
        assert tuple(heads["params"]["qkv.weight"].shape) == (48, 32)  # 3 x (32 / 2) rows


def test_torch_plan_on_a_fused_qkv_cuts_across_q_and_k(res):
    """torch's ColwiseParallel cuts the fused qkv weight contiguously (rank 0: all of q, half of k): it runs,
    and gives another function.  Ours with chunks=1 makes the same cut and equals torch bitwise (the output
    projection's bias is zero at init, so the bias order of test_zero_row_bias_is_bitwise does not enter)."""
    for rank, r in enumerate(res):
        a = r["attn"]
        ours, theirs = a["ours_contiguous"], a["torch_contiguous"]
        _close(ours["params"], theirs["params"], 0, f"rank {rank} local slices")
        _close(ours["out"], theirs["out"], 0, f"rank {rank} output")
        _close(ours["x_grad"], theirs["x_grad"], 0, f"rank {rank} input gradient")
        _close(ours["grad"], theirs["grad"], 0, f"rank {rank} local gradients")
        assert (theirs["fwd"], theirs["bwd"]) == ({"all_reduce": 1}, {"all_reduce": 1})
        wrong = (theirs["out"] - a["ref"]["out"]).abs().max().item()
        assert wrong > 1e-3, f"torch's contiguous cut of a fused qkv should differ from the model, diff {wrong}"


def test_tiny_gpt_tensor_parallel_equals_the_unsharded_gpt(res):
    for rank, r in enumerate(res):
        g = r["gpt"]
        _close(g["loss"], g["ref_loss"], REF_TOL, f"rank {rank} loss")
        _close(g["full_grad"], g["ref_grad"], REF_TOL, f"rank {rank} gathered gradients")
        assert g["shapes"]["blocks.0.attn.qkv.weight"] == (48, 32)
        assert g["shapes"]["blocks.1.mlp.2.weight"] == (32, 64)
        assert g["shapes"]["tok_emb.weight"] == (96, 32)  # not in the plan: whole on every rank


# ----------------------------------------------------------------------------- errors
def test_errors_name_the_layer_the_width_and_the_group_size(res):
    e = res[0]["errors"]
    assert e["rowwise_width"] == "ok" and e["fused_width"] == "ok"
    assert e["colwise_width"].startswith("ValueError") and all(
        s in e["colwise_width"] for s in ("ColwiseParallel", "'net.0'", "out_features=31", "group size 2"))
    assert e["rowwise_odd"].startswith("ValueError") and all(
        s in e["rowwise_odd"] for s in ("RowwiseParallel", "'net.2'", "in_features=33", "group size 2"))
    assert "out_features=9 in 3 fused blocks of 3" in e["fused_odd"] and "multiple of 6" in e["fused_odd"]
    assert e["missing_key"].startswith("ValueError") and "'fc1' names no submodule" in e["missing_key"]
    assert e["not_linear"].startswith("TypeError") and "ReLU" in e["not_linear"]
    assert e["mesh_2d"].startswith("ValueError") and "1-D mesh, got 2-D (1, 2)" in e["mesh_2d"]
    assert res[1]["errors"] == e


def test_bad_arguments_without_ranks():
    with pytest.raises(ValueError, match="chunks"):
        ColwiseParallel(chunks=0)
    with pytest.raises(ValueError, match="needs a plan"):
        parallelize_module(MLP(), None, None)
    with pytest.raises(TypeError, match="plan\\['net.0'\\]"):
        parallelize_module(MLP(), None, {"net.0": "colwise"})
    with pytest.raises(ValueError, match="kind='nccl' is unknown"):
        parallelize_module(MLP(), None, {"net.0": ColwiseParallel()}, collectives="nccl")
    assert repr(ColwiseParallel(chunks=3)) == "ColwiseParallel(chunks=3)"
    assert repr(RowwiseParallel()) == "RowwiseParallel()"
