"""The notebooks' explorers compute what the library and torch compute, for two settings each.

Oracles: the library's own functions (``build_layout``, the ring's schedule as ``simulate_ring_all_reduce`` runs it,
``ShardingPlan``), torch FSDP1's shard rule (``FlatParamHandle._get_shard``: the shard and its padding) and
torch's ``Shard(0)`` placement (``Shard._split_tensor``, ``torch.chunk`` padded: FSDP2's rows).  Everything is
exact (whole numbers); the alpha-beta times are compared with the chapter's closed forms to 1e-12 relative
(float sums in another order).  No process group is started: every oracle here is a pure function.
"""

import math

import matplotlib
import pytest
import torch
from torch.distributed.fsdp._flat_param import FlatParamHandle
from torch.distributed.tensor import Shard

from minifsdp.comm.ring_sim import simulate_ring_all_reduce
from minifsdp.explorers import flat_vs_rows, panel, ring_time, shard_layout
from minifsdp.fsdp.core.flat_param import build_layout
from minifsdp.models import GPTConfig, TinyGPT

matplotlib.use("Agg")

LAYOUTS = [{"model": "tiny", "world_size": 3, "strategy": "FULL_SHARD"},
           {"model": "mini", "world_size": 8, "strategy": "HYBRID_SHARD", "ranks_per_node": 4}]


@pytest.mark.parametrize("setting", LAYOUTS, ids=["tiny-3-full", "mini-8-hybrid"])
def test_shard_layout_is_build_layouts_and_torchs_shards(setting):
    view = shard_layout.compute(setting)
    model = TinyGPT(getattr(GPTConfig, setting["model"])(), seed=0)
    shard_size = setting.get("ranks_per_node", setting["world_size"])
    expected = [build_layout(b, list(b.parameters()), shard_size) for b in model.blocks]
    expected.append(build_layout(model, [p for n, p in model.named_parameters() if not n.startswith("blocks.")],
                                 shard_size))
    assert len(view.units) == len(expected) == model.cfg.n_layer + 1
    for unit, want in zip(view.units, expected, strict=True):
        assert unit.layout.picture() == want.picture() and unit.layout.padded_numel == want.padded_numel
        flat = torch.zeros(want.numel)
        for r in range(shard_size):  # torch FSDP1's own cut of the same flat vector
            shard, pad = FlatParamHandle._get_shard(flat, r, shard_size)
            lo, hi = unit.layout.shard_range(r)
            assert (shard.numel(), pad) == (hi - lo, max(0, hi - max(lo, want.numel)))
        # every original parameter lands once: its pieces over the shards add up to it
        covered = [0] * len(want.slots)
        for r in range(shard_size):
            for i, (lo, hi) in enumerate(unit.layout.local_pieces(r)):
                covered[i] += hi - lo
        assert covered == [s.numel for s in want.slots]
    held = sum(lay.shard_numel for lay in expected)
    assert [view.held_at_rest(r) for r in range(setting["world_size"])] == [held] * setting["world_size"]
    assert [view.shard_of(r) for r in range(setting["world_size"])] == [r % shard_size
                                                                          for r in range(setting["world_size"])]


def test_the_strategy_decides_what_is_split_and_what_is_kept_after_forward():
    full, zero2, none = (shard_layout.compute({"world_size": 4, "strategy": s})
                         for s in ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"))
    assert full.shard_size == zero2.shard_size == 4 and none.shard_size == 1
    assert full.held_at_rest(0) == zero2.held_at_rest(0) < none.held_at_rest(0) == 29_568  # the tiny GPT
    blocks = [u.layout for u in full.units if u.name != "root"]
    assert full.held_between_forward_and_backward(0) == sum(lay.shard_numel for lay in blocks)
    assert zero2.held_between_forward_and_backward(0) == sum(lay.padded_numel for lay in blocks)
    with pytest.raises(ValueError, match="divisible"):
        shard_layout.compute({"world_size": 3, "strategy": "HYBRID_SHARD", "ranks_per_node": 2})


RINGS = [{"message_bytes": 2**16, "world_size": 4, "alpha_us": 10.0, "bandwidth_gbps": 10.0},
         {"message_bytes": 4 * 1000, "world_size": 3, "alpha_us": 380.0, "bandwidth_gbps": 1.5}]


@pytest.mark.parametrize("setting", RINGS, ids=["64KiB-4", "1000-fp32-3"])
def test_ring_time_counts_the_simulated_rings_rounds_and_bytes(setting):
    view = ring_time.compute(setting)
    n, size = setting["world_size"], setting["message_bytes"]
    trace = simulate_ring_all_reduce([torch.ones(size // 4) for _ in range(n)])
    rounds = {(s.phase, s.step) for s in trace.steps}
    sent = [4 * sum(len(s.values) for s in trace.steps if s.sender == r) for r in range(n)]
    ring = view.costs["ring"]
    assert (ring.rounds, ring.busiest_bytes) == (len(rounds), max(sent))
    alpha, beta = setting["alpha_us"] * 1e-6, 1 / (setting["bandwidth_gbps"] * 1e9)
    if size % (4 * n) == 0:  # equal chunks: the chapter's closed form
        assert ring.busiest_bytes == 2 * (n - 1) * size // n
        assert ring.seconds == pytest.approx(2 * (n - 1) * alpha + 2 * (n - 1) / n * size * beta, rel=1e-12)
    else:  # a round waits for its largest chunk, ceil(S / N)
        largest = 4 * math.ceil(size // 4 / n)
        assert ring.seconds == pytest.approx(2 * (n - 1) * (alpha + beta * largest), rel=1e-12)
    ps, tree = view.costs["parameter server"], view.costs["tree"]
    assert ps.busiest_bytes == (n - 1) * size  # the root sends the sum to every other rank (naive_all_reduce)
    assert ps.seconds == pytest.approx(2 * (n - 1) * (alpha + beta * size), rel=1e-12)
    assert tree.rounds == 2 * math.ceil(math.log2(n))
    if size in view.sizes:  # the curves the panel draws pass through the table's times
        assert [view.curves[a][view.sizes.index(size)] for a in view.costs] == [c.seconds for c in view.costs.values()]
    assert len(view.states) == 2 * (n - 1) + 1  # the ring's picture: the start, then each round


def test_small_messages_on_many_ranks_favour_the_tree_large_ones_the_ring():
    assert ring_time.compute({"message_bytes": 4096, "world_size": 64}).fastest == "tree"
    assert ring_time.compute({"message_bytes": 2**28, "world_size": 64}).fastest == "ring"
    measured = ring_time.compute({"world_size": 2}).measured
    assert len(measured) >= 4 and all(b > 0 and t > 0 for b, t in measured)  # the committed bench run


ROWS = [{"shape": "96, 32", "world_size": 5}, {"shape": (5, 4, 3), "world_size": 4}, {"shape": "3", "world_size": 4}]


@pytest.mark.parametrize("setting", ROWS, ids=["96x32-5", "5x4x3-4", "3-4"])
def test_fsdp2_rows_are_torchs_shard0_and_fsdp1_slices_torchs_flat_shard(setting):
    view = flat_vs_rows.compute(setting)
    shape, n = flat_vs_rows.parse_shape(setting["shape"]), setting["world_size"]
    full = torch.arange(math.prod(shape)).reshape(shape)
    chunks = list(torch.chunk(full, n, dim=0))
    chunks += [full[:0]] * (n - len(chunks))  # torch.chunk may give fewer than N; torch's Shard(0) gives empties
    pieces, pads = Shard(0)._split_tensor(full, n, with_padding=True)
    assert len(view.rows) == len(pieces) == n
    for r, row in enumerate(view.rows):
        assert row.local_shape == tuple(chunks[r].shape)
        assert torch.equal(full[row.start:row.end], chunks[r])
        assert row.padding_rows == pads[r]
    flat = full.reshape(-1)
    for r, piece in enumerate(view.flat):
        shard, pad = FlatParamHandle._get_shard(flat, r, n)
        assert (piece.end - piece.start, piece.padding) == (shard.numel(), pad)
        assert torch.equal(flat[piece.start:min(piece.end, flat.numel())], shard[:shard.numel() - pad])
    assert view.flat_padding == view.flat[-1].end - flat.numel()


def test_a_shape_that_is_not_one_is_refused():
    for bad in ("", "96, -1", "a, b", "0"):
        with pytest.raises(ValueError, match="positive whole numbers"):
            flat_vs_rows.compute({"shape": bad})


@pytest.mark.parametrize("module, control, value", [(shard_layout, "world_size", 5),
                                                    (ring_time, "world_size", 7),
                                                    (flat_vs_rows, "shape", "7, 3")])
def test_moving_a_control_prints_what_compute_gives_for_the_new_setting(module, control, value, capsys):
    """Outside a kernel the panel's output area prints to stdout: read it before and after a control moves."""
    pytest.importorskip("ipywidgets")
    box = module.panel()
    controls = {c.description: c for c in box.children[1].children}
    assert _text(module, {}) in capsys.readouterr().out  # drawn once for the default setting
    name = {"world_size": "N", "shape": "shape"}[control]
    controls[name].value = value
    assert _text(module, {control: value}) in capsys.readouterr().out
    assert panel.NEEDS_KERNEL in _fallback(module, capsys)


def _text(module, setting: dict) -> str:
    view = module.compute(setting)
    return {"shard_layout": shard_layout.format_view, "ring_time": ring_time.format_times,
            "flat_vs_rows": flat_vs_rows.format_view}[module.__name__.rsplit(".", 1)[1]](view)


def _fallback(module, capsys) -> str:
    module.fallback()
    return capsys.readouterr().out
