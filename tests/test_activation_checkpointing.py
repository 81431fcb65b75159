"""Activation checkpointing under FSDP (chapter 4.1): same numbers, fewer saved activations.

Oracles, 2 ranks, TinyGPT with each Block its own FSDP unit and checkpointed inside it,
4 AdamW steps, use_orig_params False and True:
* ours without checkpointing: BITWISE (losses, local shards, full parameters): the
  recompute runs the same CPU kernels on the same inputs, so it saves the same numbers;
* torch FSDP1 + torch's ``apply_activation_checkpointing`` (NO_REENTRANT ``checkpoint_wrapper``):
  BITWISE, for the same reason;
* checkpointing applied before wrapping: bitwise the same losses as after wrapping.
Memory (MemoryTracker, one step, rank-local): activations saved for backward at the peak
drop to (almost) nothing, and the peak itself drops.
"""

import numpy as np
import pytest
import torch

import minifsdp
from minifsdp.fsdp.activation_checkpointing import apply_activation_checkpointing, checkpoint
from minifsdp.models import Block, TinyGPT
from tests import _workers_overlap as W
from tests._workers_fsdp import full_items, pairs


@pytest.fixture(scope="module")
def runs():
    return minifsdp.spawn(W.checkpointing_worker, world_size=2, timeout_s=240)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("orig", (False, True))
@pytest.mark.parametrize("oracle", ("no_ac", "torch"))
def test_fsdp_with_checkpointing_bitwise(runs, orig, oracle):
    for res in runs:
        ours, other = res[("ac", orig)]["ours"], res[("ac", orig)][oracle]
        assert ours["losses"] == other["losses"]
        for a, b in pairs(ours["shards"], other["shards"]):
            assert np.array_equal(a, b)
        for name, a, b in full_items(ours["full"], other["full"]):
            assert np.array_equal(a, b), name


def test_before_wrapping_is_the_same(runs):
    for res in runs:
        assert res["before_wrap_losses"] == res[("ac", False)]["ours"]["losses"]


def test_checkpointing_saves_activation_memory(runs):
    for res in runs:
        plain, ac = res[("peak", False)], res[("peak", True)]
        assert ac["activations"] < 0.05 * plain["activations"]
        assert ac["total"] < plain["total"]


def test_plain_model_bitwise_and_recompute_runs():
    """Single process: gradients bitwise equal; the block's insides really run twice with checkpointing."""
    x = torch.randint(0, 96, (4, 32), generator=torch.Generator().manual_seed(0))
    grads, inner_calls = [], []
    for ac in (False, True):
        m = TinyGPT(seed=0)
        calls = []
        m.blocks[0].ln1.register_forward_hook(lambda *a, calls=calls: calls.append(1))
        if ac:
            apply_activation_checkpointing(m, check_fn=lambda mod: isinstance(mod, Block))
        m(x, x).backward()
        grads.append([p.grad for p in m.parameters()])
        inner_calls.append(len(calls))
    assert all(torch.equal(a, b) for a, b in pairs(*grads))
    assert inner_calls == [1, 2]  # forward, then the recompute in backward


def test_rng_state_replayed():
    """A dropout inside a checkpointed function draws the same mask in the recompute."""
    w = torch.randn(8, generator=torch.Generator().manual_seed(0)).requires_grad_()
    torch.manual_seed(0)
    out = checkpoint(lambda t: torch.nn.functional.dropout(t * 2, 0.5, training=True), w)
    out.sum().backward()
    torch.manual_seed(0)
    w2 = w.detach().clone().requires_grad_()
    torch.nn.functional.dropout(w2 * 2, 0.5, training=True).sum().backward()
    assert torch.equal(w.grad, w2.grad)


def test_bad_check_fn():
    with pytest.raises(ValueError, match="matched no module"):
        apply_activation_checkpointing(TinyGPT(seed=0), check_fn=lambda m: False)
