"""Device paths on CPU: where control tensors live, and what checkpointing's recompute replays.

Part 1, control tensors (FSDP's wrap-time checksums, DDP's shape signature, the
grad scaler's found-inf flag).  A plain "nccl" group moves CUDA tensors only, so
``collective_device`` must never answer "cpu" for it, and must answer "cpu" for
gloo (so the CPU path stays what it was).  The pure choices are checked by backend
name; 2 real gloo ranks check that the flags and checksums still agree (the NCCL
side runs in ``tests/gpu/``).

Part 2, activation checkpointing's recompute.  Oracles: the same block without
checkpointing, and ``torch.utils.checkpoint.checkpoint(use_reentrant=False)``.
Tolerance: BITWISE (outputs, input and parameter gradients): the recompute runs
the same CPU kernels in the same RNG and autocast state.  Under
``torch.autocast("cpu", dtype=torch.bfloat16)`` a recompute that forgets the
autocast state runs in fp32, and the backward fails ("expected m1 and m2 to have
the same dtype"): that is what these tests caught before the fix.
"""

import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.utils.checkpoint as torch_cp

import minifsdp
from minifsdp.comm.devices import backend_devices, check_backend_supports, collective_device
from minifsdp.fsdp import full_params
from minifsdp.fsdp.activation_checkpointing import _autocast_state, _input_devices, checkpoint
from minifsdp.models import TinyGPT
from tests import _workers_device as W
from tests._workers_fsdp import assert_bitwise

# --- part 1: control tensors --------------------------------------------------------------------


@pytest.mark.parametrize("backend, devices", [("gloo", ["cpu", "cuda"]), ("nccl", ["cuda"]),
                                              ("cpu:gloo,cuda:nccl", ["cpu", "cuda"]), ("GLOO", ["cpu", "cuda"])])
def test_backend_devices_by_name(backend, devices):
    assert backend_devices(backend) == devices


def test_gloo_and_mixed_groups_keep_control_tensors_on_cpu():
    assert collective_device("gloo") == torch.device("cpu")
    assert collective_device("cpu:gloo,cuda:nccl") == torch.device("cpu")
    assert collective_device("gloo", like=torch.zeros(1)) == torch.device("cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU answer")
def test_nccl_never_gets_a_cpu_tensor():
    """With no GPU there is no right device for NCCL: a clear error, never a silent CPU tensor."""
    with pytest.raises(RuntimeError, match="no device for a collective on backend 'nccl'"):
        collective_device("nccl")
    with pytest.raises(RuntimeError, match="no device for a collective"):
        collective_device("nccl", like=torch.zeros(1))  # a CPU module tensor is no answer either


def test_cpu_module_on_nccl_is_a_clear_error():
    with pytest.raises(ValueError, match=r"DDP: the module is on cpu, but .*'nccl' moves only cuda"):
        check_backend_supports("nccl", [torch.zeros(1)], "DDP")
    check_backend_supports("gloo", [torch.zeros(1)], "DDP")
    check_backend_supports("cpu:gloo,cuda:nccl", [torch.zeros(1)], "DDP")


@pytest.fixture(scope="module")
def ranks():
    return minifsdp.spawn(W.device_paths_worker, world_size=2, timeout_s=120)


@pytest.mark.timeout(120)
def test_gloo_ranks_pick_cpu(ranks):
    for res in ranks:
        assert res["backend"] == "gloo"
        assert res["devices"] == ["cpu", "cuda"]
        assert res["collective_device"] == ["cpu", "cpu", "cpu"]
        assert res["supports_cpu"] is None


def test_checksums_agree_and_disagree_as_before(ranks):
    for res in ranks:
        assert res["same_weights"] is None
        assert res["diff_weights"] and "differs across ranks at wrap time (weight)" in res["diff_weights"]
        assert res["after_broadcast"] is None
        assert res["weight_after_broadcast"] == [0.0] * 16  # rank 0's weights everywhere
        assert res["shapes"] and "parameter #0 differs" in res["shapes"]


def test_grad_scaler_flag_agrees_with_a_rank_without_gradients(ranks):
    """Rank 0 has no gradients at all; rank 1 overflows at step 1: both see the flag, skip, back off."""
    r0, r1 = ranks[0]["scaler"], ranks[1]["scaler"]
    assert [(f, d, s) for f, d, _, s in r0] == [(f, d, s) for f, d, _, s in r1]
    assert [f for f, *_ in r0] == [0.0, 1.0, 0.0]
    assert all(d == "cpu" for _, d, *_ in r0)
    assert [s for *_, s in r0] == [4.0, 2.0, 2.0]
    assert [st for _, _, st, _ in r1] == [True, False, True]


# --- the gradient norm's all-reduce: on the collective's device, on a rank without gradients too -----
# A CPU zero (``torch.tensor(0.0)``) was all-reduced when a rank had no gradients: NCCL refuses it.
# With no GPU here, a "meta" tensor stands in for the device that ``collective_device`` answers
# for a plain "nccl" group: the all-reduce must see that device, never the CPU.


@pytest.mark.parametrize("grads", ([], [torch.ones(3), torch.full((2, 2), 2.0)]))
def test_local_grad_norm_lands_on_the_given_device(grads):
    """full_params.grad_norm: the local norm is made on (or moved to) the all-reduce's device."""
    assert full_params.grad_norm(grads, 2.0, torch.device("meta")).device.type == "meta"
    cpu = full_params.grad_norm(grads, 2.0, torch.device("cpu"))
    expected = torch.tensor(float(sum(g.pow(2).sum() for g in grads)) ** 0.5)  # 0 without gradients
    assert cpu.dtype == torch.float32 and torch.equal(cpu, expected)


def clip_norm_worker() -> dict:
    """FSDP.clip_grad_norm_ on 2 gloo ranks, without gradients, then with: which device was chosen and used."""
    asked, seen = [], []
    real_device, real_all_reduce = full_params.collective_device, dist.all_reduce

    def recording_device(group=None, like=None):
        d = real_device(group, like)
        asked.append((group is model.groups.shard, like is model._handle.flat_param, str(d)))
        return d

    def recording_all_reduce(t, *a, **k):
        seen.append(str(t.device))
        return real_all_reduce(t, *a, **k)

    torch.manual_seed(0)
    model = minifsdp.FullyShardedDataParallel(nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 3)))
    full_params.collective_device, dist.all_reduce = recording_device, recording_all_reduce
    out = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no gradients": torch's warning, tested elsewhere
        out["empty"] = (model.clip_grad_norm_(1.0).item(), list(asked), list(seen))
    asked.clear(), seen.clear()
    model(torch.full((2, 4), float(dist.get_rank() + 1))).sum().backward()
    out["grads"] = (model.clip_grad_norm_(1.0).item(), list(asked), list(seen))
    full_params.collective_device, dist.all_reduce = real_device, real_all_reduce
    return out


def test_fsdp_clip_grad_norm_all_reduces_where_collective_device_says():
    """Both ranks, with and without gradients: asked about the shard group and the flat parameter, used."""
    for res in minifsdp.spawn(clip_norm_worker, world_size=2, timeout_s=120):
        assert res["empty"] == (0.0, [(True, True, "cpu")], ["cpu"])
        norm, asked, seen = res["grads"]
        assert norm > 0 and asked == [(True, True, "cpu")] and seen == ["cpu"]


# --- part 2: activation checkpointing replays RNG and autocast ---------------------------------


def _block_and_input():
    gpt = TinyGPT(seed=0)
    x = torch.randn(4, 32, gpt.tok_emb.weight.shape[1], generator=torch.Generator().manual_seed(1))
    return gpt.blocks[0], x


def _run(module, x0, mode, autocast: bool, seed=None):
    """(output, input grad, parameter grads) of ``module`` under the given checkpointing mode."""
    module.zero_grad(set_to_none=True)
    x = x0.clone().requires_grad_()
    if seed is not None:
        torch.manual_seed(seed)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        if mode == "plain":
            y = module(x)
        elif mode == "ours":
            y = checkpoint(module, x)
        else:
            y = torch_cp.checkpoint(module, x, use_reentrant=False)
    torch.rand(7)  # the RNG moves on between forward and backward: the recompute must not care
    y.float().pow(2).sum().backward()
    return y.detach(), x.grad, [p.grad for p in module.parameters()]


@pytest.mark.parametrize("oracle", ("plain", "torch"))
def test_autocast_block_bitwise(oracle):
    """A TinyGPT Block under CPU bf16 autocast: ours == no checkpointing == torch's checkpoint, bit for bit."""
    block, x = _block_and_input()
    ours = _run(block, x, "ours", autocast=True)
    assert not torch.equal(ours[1], _run(block, x, "plain", autocast=False)[1])  # guard: autocast really acted
    assert_bitwise(ours, _run(block, x, oracle, autocast=True), f"(output, input grad, parameter grads), {oracle}")


@pytest.mark.parametrize("autocast", (False, True))
@pytest.mark.parametrize("oracle", ("plain", "torch"))
def test_dropout_masks_replayed(autocast, oracle):
    """Dropout in the checkpointed block: the recompute draws the forward's mask, so gradients are bitwise."""
    torch.manual_seed(0)
    c = 32
    block = nn.Sequential(nn.Linear(c, 4 * c), nn.Dropout(0.5), nn.GELU(), nn.Linear(4 * c, c))
    x = torch.randn(4, 8, c, generator=torch.Generator().manual_seed(2))
    ours = _run(block, x, "ours", autocast, seed=123)
    theirs = _run(block, x, oracle, autocast, seed=123)
    assert_bitwise(ours, theirs, f"(output, input grad, parameter grads), {oracle}")
    other_mask = _run(block, x, "plain", autocast, seed=124)  # guard: another seed gives other gradients
    assert not torch.equal(ours[2][0], other_mask[2][0])


def test_recompute_leaves_rng_and_autocast_as_it_found_them():
    block, x = _block_and_input()
    torch.manual_seed(5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = checkpoint(block, x.clone().requires_grad_())
    state = torch.get_rng_state()
    y.float().sum().backward()  # the recompute runs here, under the forward's RNG and autocast
    assert torch.equal(torch.get_rng_state(), state)
    assert not torch.is_autocast_enabled("cpu")


def test_saved_context():
    """What a checkpointed call records: no accelerator devices for CPU inputs; cpu's autocast state."""
    x = torch.zeros(2)
    assert _input_devices((x, [x], {"k": x}), {"kw": x}) == []
    assert ("cpu", {"enabled": False, "dtype": torch.get_autocast_dtype("cpu"),
                    "cache_enabled": torch.is_autocast_cache_enabled()}) in _autocast_state([])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        cpu = dict(_autocast_state([]))["cpu"]
    assert cpu["enabled"] and cpu["dtype"] == torch.bfloat16
