"""Flat parameters (chapter 2.1), single process: layout, padding, shards, views, tied weights.

Layout parity with torch FSDP1 across ranks (each rank's shard equals torch's
``FlatParameter`` shard element for element) is checked in
``test_fsdp_parity.py`` (use_orig_params=False and, with its 16-byte alignment, True).
"""

import pytest
import torch
import torch.nn as nn

from minifsdp import build_layout, flatten, shard, unflatten
from minifsdp.fsdp.orig_params import aligned
from minifsdp.models import MLP, TinyGPT


def test_order_padding_and_shards():
    m = nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 1))  # 6 + 2 + 2 + 1 = 11 numbers
    params = list(m.parameters())
    layout = build_layout(m, params, world_size=4)
    assert [s.fqn for s in layout.slots] == [n for n, _ in m.named_parameters()]
    assert [s.offset for s in layout.slots] == [0, 6, 8, 10]
    assert (layout.numel, layout.padded_numel, layout.shard_numel) == (11, 12, 3)
    flat = flatten(layout)
    assert torch.equal(flat[:11], torch.cat([p.detach().reshape(-1) for p in params]))
    assert flat[11] == 0  # the padding is zeros at the end
    shards = [shard(flat, r, 4) for r in range(4)]
    assert torch.equal(torch.cat(shards), flat)
    # torch's rule: flat.chunk(N)[r] padded to the first chunk's size
    for r, chunk in enumerate(flat[:11].chunk(4)):
        assert torch.equal(shards[r][: chunk.numel()], chunk)
    assert "padding x1" in layout.picture().splitlines()[3]


def test_views_restore_params_and_carry_gradients():
    m = MLP((4, 5, 3), seed=0)
    params = list(m.parameters())
    layout = build_layout(m, params, world_size=3)
    flat = flatten(layout).requires_grad_()
    views = unflatten(flat, layout)
    for v, p in zip(views, params):
        assert v.shape == p.shape and torch.equal(v, p)
        assert v.data_ptr() >= flat.data_ptr()  # a view into the buffer, not a copy
    sum(v.sum() * (i + 1) for i, v in enumerate(views)).backward()
    for s in layout.slots:
        idx = layout.slots.index(s) + 1
        assert torch.all(flat.grad[s.offset : s.offset + s.numel] == idx)
    assert torch.all(flat.grad[layout.numel :] == 0)


def test_tied_weight_is_stored_once():
    gpt = TinyGPT(seed=0)
    layout = build_layout(gpt, list(gpt.parameters()), world_size=2)
    fqns = [s.fqn for s in layout.slots]
    assert "tok_emb.weight" in fqns and "lm_head.weight" not in fqns
    assert [(sh.fqn, layout.slots[sh.primary].fqn) for sh in layout.shared] == [("lm_head.weight", "tok_emb.weight")]
    assert layout.numel == sum(p.numel() for p in gpt.parameters())  # parameters() also counts it once


def test_alignment_for_use_orig_params():
    m = nn.Sequential(nn.Linear(3, 1), nn.Linear(1, 2))  # 3, 1, 2, 2
    layout = aligned(build_layout(m, list(m.parameters()), world_size=2), 4, 2)
    assert [s.offset for s in layout.slots] == [0, 4, 8, 12]
    views = unflatten(flatten(layout), layout)
    assert all(torch.equal(v, p) for v, p in zip(views, m.parameters()))


def test_local_pieces_cover_each_parameter_once():
    gpt = TinyGPT(seed=0)
    layout = build_layout(gpt, list(gpt.parameters()), world_size=3)
    covered = [0] * len(layout.slots)
    for r in range(3):
        for i, (lo, hi) in enumerate(layout.local_pieces(r)):
            covered[i] += hi - lo
    assert covered == [s.numel for s in layout.slots]


class _Params(nn.Module):
    """Parameters of the given sizes, holding 1, 2, 3, ... in flat order (so padding, 0, stands out)."""

    def __init__(self, numels):
        super().__init__()
        start = 1
        for i, n in enumerate(numels):
            setattr(self, f"p{i}", nn.Parameter(torch.arange(start, start + n, dtype=torch.float32)))
            start += n


# totals 1, 5, 7, 11, 13, 25: none is a multiple of 2, 3 or 4, so every sharded layout pads its last shards;
# and 12, which all of them divide: there the last rank's range ends on a real number, not on padding
SIZES = [(1,), (5,), (3, 4), (6, 2, 3), (7, 6), (10, 1, 2, 12), (8, 4)]


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("numels", SIZES, ids=lambda s: "+".join(map(str, s)))
def test_shard_ranges_are_torch_fsdp1_shards(numels, world):
    """Each rank's shard range, its shard and its pieces are torch FSDP1's, the last ranks' included.

    Oracle: torch FSDP1's own sharding rule, ``FlatParamHandle._get_shard`` /
    ``_get_unpadded_shard``: ``flat.chunk(N)[r]`` padded with zeros to the first chunk's size, and
    an all-padding shard for a rank past the last chunk (5 numbers on 4 ranks: chunks 2, 2, 1, none).
    Bitwise: ``flatten(layout)[shard_range(r)]`` and ``shard(flat, r, N)`` are torch's padded shard,
    ``local_pieces(r)`` cuts each parameter where torch's chunk does.
    """
    from torch.distributed.fsdp._flat_param import FlatParamHandle

    m = _Params(numels)
    layout = build_layout(m, list(m.parameters()), world_size=world)
    total = sum(numels)
    assert (layout.numel, layout.padded_numel) == (total, -(-total // world) * world)
    flat = flatten(layout)
    unpadded = torch.cat([p.detach() for p in m.parameters()])
    positions = torch.arange(total)
    ends = []
    for r in range(world):
        want, pad = FlatParamHandle._get_shard(unpadded, r, world)
        start, end = layout.shard_range(r)
        assert end - start == want.numel(), (r, (start, end), want.numel())
        assert torch.equal(flat[start:end], want), (r, flat[start:end], want)
        assert torch.equal(shard(flat, r, world), want), r
        chunk, _ = FlatParamHandle._get_unpadded_shard(positions, r, world)  # which flat numbers torch gives r
        lo = int(chunk[0]) if chunk.numel() else total
        expect = []
        for s in layout.slots:
            a, b = max(s.offset, lo), min(s.offset + s.numel, lo + chunk.numel())
            expect.append((a - lo, b - lo) if a < b else (0, 0))
        assert layout.local_pieces(r) == expect, (r, layout.local_pieces(r), expect)
        ends.append((start, end))
    assert ends[0][0] == 0 and ends[-1][1] == layout.padded_numel
    assert all(e == s for (_, e), (s, _) in zip(ends, ends[1:]))  # the ranges tile the padded buffer
