"""Activation checkpointing on CUDA: the recompute replays the CUDA RNG and CUDA autocast.

Needs one GPU (``conftest.py``); runs in this process on cuda:0.
Oracles: the same block without checkpointing, and ``torch.utils.checkpoint.checkpoint
(use_reentrant=False)``.  Tolerance: BITWISE (output, input and parameter gradients):
the same kernels on the same inputs in the same RNG and autocast state.  A recompute
that replays only the CPU generator draws other dropout masks on the GPU; one that
forgets autocast recomputes in fp32 and its backward fails or differs.
"""

import pytest
import torch
import torch.nn as nn
import torch.utils.checkpoint as torch_cp

from minifsdp.fsdp.activation_checkpointing import _device_rng_states, _input_devices, checkpoint
from minifsdp.models import TinyGPT

DEVICE = "cuda:0"


def _run(module, x0, mode, dtype=None, seed=None):
    module.zero_grad(set_to_none=True)
    x = x0.clone().requires_grad_()
    if seed is not None:
        torch.manual_seed(seed)  # seeds the CPU and every CUDA generator
    with torch.autocast("cuda", dtype=dtype or torch.float16, enabled=dtype is not None):
        if mode == "plain":
            y = module(x)
        elif mode == "ours":
            y = checkpoint(module, x)
        else:
            y = torch_cp.checkpoint(module, x, use_reentrant=False)
    torch.rand(7, device=DEVICE)  # the CUDA RNG moves on before backward: the recompute must not care
    y.float().pow(2).sum().backward()
    return y.detach(), x.grad, [p.grad for p in module.parameters()]


def _assert_bitwise(a, b):
    assert a[0].dtype == b[0].dtype and torch.equal(a[0], b[0])
    assert torch.equal(a[1], b[1])
    assert all(torch.equal(p, q) for p, q in zip(a[2], b[2]))


@pytest.mark.parametrize("dtype", (None, torch.bfloat16, torch.float16))
@pytest.mark.parametrize("oracle", ("plain", "torch"))
def test_cuda_dropout_masks_replayed(dtype, oracle):
    torch.manual_seed(0)
    c = 64
    block = nn.Sequential(nn.Linear(c, 4 * c), nn.Dropout(0.5), nn.GELU(), nn.Linear(4 * c, c)).to(DEVICE)
    x = torch.randn(4, 16, c, device=DEVICE)
    ours = _run(block, x, "ours", dtype, seed=123)
    _assert_bitwise(ours, _run(block, x, oracle, dtype, seed=123))
    assert not torch.equal(ours[2][0], _run(block, x, "plain", dtype, seed=124)[2][0])  # guard: masks matter


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16))
@pytest.mark.parametrize("oracle", ("plain", "torch"))
def test_cuda_autocast_block_bitwise(dtype, oracle):
    gpt = TinyGPT(seed=0).to(DEVICE)
    x = torch.randn(4, 32, gpt.tok_emb.weight.shape[1], device=DEVICE)
    _assert_bitwise(_run(gpt.blocks[0], x, "ours", dtype), _run(gpt.blocks[0], x, oracle, dtype))


def test_cuda_rng_restored_after_recompute():
    block = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5)).to(DEVICE)
    x = torch.randn(2, 8, device=DEVICE, requires_grad=True)
    y = checkpoint(block, x)
    assert _input_devices((x,), {}) == [torch.device(DEVICE)]
    assert len(_device_rng_states([x.device])) == 1
    state = torch.cuda.get_rng_state(DEVICE)
    y.sum().backward()  # the recompute sets the forward's CUDA state, then puts this one back
    assert torch.equal(torch.cuda.get_rng_state(DEVICE), state)
