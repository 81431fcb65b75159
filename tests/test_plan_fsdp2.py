"""``plan --impl fsdp2``: fully_shard's per-parameter layout and its ``reshard_after_forward`` settings.

Oracles: ``minifsdp.fsdp2``'s own ``FSDPParam`` built on every parameter of the book's models (one process, no
mesh: the layout is arithmetic), rank by rank, for the padded shards and the rows each rank owns; torch's
``_get_post_forward_mesh_info`` for which ints it accepts (k = 1 is False, k = N is True); for the collectives,
the ring formula ((k - 1)/k of what a group of k gathers).  Exact.  The measured step is
``tests/test_plan_fsdp2_measured.py`` (``--extended``).
"""

from __future__ import annotations

import pytest
import torch.nn as nn

from minifsdp.fsdp2.core.param import FSDPParam, chunk_rows, local_row_range
from minifsdp.memory import plan_fsdp2
from minifsdp.memory.plan import Run, collectives, model_state, moments
from minifsdp.memory.plan_shapes import PRESETS, ModelShape
from minifsdp.models import MLP, GPTConfig, TinyGPT


@pytest.mark.parametrize("n", [2, 3, 5])
def test_per_parameter_padding_is_fsdp2s_own(n):
    for d0 in (1, 2, 7, 33, 96, 128):
        assert plan_fsdp2.chunk_rows(d0, n) == chunk_rows(d0, n)
        assert all(plan_fsdp2.local_row_range(d0, n, r) == local_row_range(d0, n, r) for r in range(n))
    models = {"tiny": TinyGPT(GPTConfig.tiny(), seed=0), "mlp-odd": MLP((12, 33, 7), seed=0)}
    shapes = {"tiny": PRESETS["tiny"], "mlp-odd": ModelShape("mlp-odd", "mlp", dims=(12, 33, 7))}
    for name, model in models.items():
        params = list(model.parameters())
        assert sorted(p.numel() for p in params) == sorted(e for unit in shapes[name].tensor_numels() for e in unit)
        for rank in range(n):
            fsdp = [FSDPParam(nn.Parameter(p.detach().clone()), [], rank, n) for p in params]
            assert sum(plan_fsdp2.padded_shards(shapes[name], "layer", n)) == sum(p.shard_numel for p in fsdp)
            assert sum(plan_fsdp2.local_elements(shapes[name], "layer", n, rank)) == \
                sum(p.local_tensor.numel() for p in fsdp)


def test_fsdp2_pads_each_parameter_fsdp1_the_flat_unit():
    shape = ModelShape("odd", "mlp", dims=(12, 33, 7))  # units of 429 and 238 elements
    one, two = Run(world_size=2), Run(world_size=2, impl="fsdp2")
    assert model_state(shape, one)["parameters"] == 4 * (215 + 119)  # ceil(429 / 2) + ceil(238 / 2)
    assert model_state(shape, two)["parameters"] == 4 * (17 * 12 + 17 + 4 * 33 + 4)  # rows 33 -> 17, 7 -> 4
    # the optimizer's state is each rank's real rows: rank 1 owns 16 of 33 rows and 3 of 7
    assert model_state(shape, two, 1)["optimizer_state"] == 8 * (16 * 12 + 16 + 3 * 33 + 3) + 4 * 4


def _backward_gathers(run):
    return [(c.unit, c.group_size, c.bytes_sent) for c in collectives(PRESETS["llama-7b"], run)
            if c.kind == "all-gather" and c.phase == "backward"]


def test_reshard_after_forward_sets_the_backwards_all_gathers():
    shape, n = PRESETS["llama-7b"], 64
    base = dict(world_size=n, impl="fsdp2", precision="bf16")
    blocks = range(1, shape.layers + 1)
    s = plan_fsdp2.padded_shards(shape, "layer", n)
    assert _backward_gathers(Run(**base)) == [(i, n, s[i] * (n - 1) * 2) for i in reversed(blocks)]
    assert _backward_gathers(Run(**base, reshard_after_forward="false")) == []
    assert _backward_gathers(Run(**base, reshard_after_forward="TorchTitan")) == \
        [(i, n, s[i] * (n - 1) * 2) for i in reversed(blocks) if i != shape.layers]  # the last block kept
    eight = _backward_gathers(Run(**base, reshard_after_forward="8"))
    assert eight == [(i, 8, s[i] * n // 8 * 7 * 2) for i in reversed(blocks)]  # inside a node, 1/8 kept each
    assert all(not c.across_nodes for c in collectives(shape, Run(**base, reshard_after_forward=8))
               if c.group_size == 8)
    # torch's reading of the int: 1 is False, N is True; one that does not divide N is refused
    assert Run(**base, reshard_after_forward=1).reshard_after_forward == "false"
    assert Run(**base, reshard_after_forward=64).reshard_after_forward == "true"
    with pytest.raises(ValueError, match="--reshard-after-forward 3: .* must divide the 64 ranks"):
        Run(**base, reshard_after_forward=3)


def test_what_each_block_keeps_until_its_backward():
    shape, n = PRESETS["llama-7b"], 64
    s = plan_fsdp2.padded_shards(shape, "layer", n)
    gathered = [x * n * 2 for x in s]

    def at_backward_start(reshard):
        run = Run(world_size=n, impl="fsdp2", precision="bf16", reshard_after_forward=reshard)
        return next(m for w, m in moments(shape, run) if w.startswith("backward, start"))["unsharded_parameters"]

    # the root always; true: the last block prefetched; false: every block; 8: 1/8 of each, the last one whole
    assert at_backward_start("true") == gathered[0] + gathered[-1]
    assert at_backward_start("torchtitan") == gathered[0] + gathered[-1]
    assert at_backward_start("false") == sum(gathered)
    assert at_backward_start("8") == gathered[0] + sum(g // 8 for g in gathered[1:-1]) + gathered[-1]


@pytest.mark.parametrize("strategy", ["SHARD_GRAD_OP", "NO_SHARD", "DDP", "HYBRID_SHARD"])
def test_fsdp2_takes_full_shard_only_and_says_what_to_use(strategy):
    with pytest.raises(ValueError, match=f"--impl fsdp2 takes --strategy FULL_SHARD only.*for {strategy}, "):
        Run(world_size=16, strategy=strategy, impl="fsdp2")
