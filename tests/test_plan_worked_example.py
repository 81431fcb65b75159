"""``python -m minifsdp plan``'s time, held to absolute numbers worked by hand in chapter 2.3, not only to ratios.

The oracle is the arithmetic of "The time, worked by hand" in chapter 2.3's appendix part on the plan at real scale
(``chapters/02_fsdp_core_deeper.md``; Llama 2 7B, bf16, one 4,096-token
sequence per H100, N = 8 and 64), written out below from the model's shape and the datasheet's figures (989
dense bf16 TFLOP/s, 3,600 Gbit/s NVLink and 400 Gbit/s InfiniBand each way), not read from the code under
test.  Ratios of network times survive a unit slip (bits for bytes in a link speed, a missing factor of 6 or
8); these absolute values do not.  Tolerance: 1e-9 relative (float division).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from minifsdp.commands.cli import main

CHAPTER = Path(__file__).resolve().parents[1] / "chapters" / "02_fsdp_core_deeper.md"  # chapter 2.3, going deeper

P, ROOT_UNIT = 6_738_415_616, 2 * 32_000 * 4_096 + 4_096  # Llama 2 7B; the root unit: embeddings, norm, head
MATMUL = 32 * (2 * 4_096**2 + 2 * 4_096 * 4_096 + 3 * 4_096 * 11_008) + 32_000 * 4_096
FLOPS = 6 * MATMUL * 4_096 + 12 * 32 * 4_096 * 4_096 * 4_096  # per GPU per step
COMPUTE_S = FLOPS / 989e12
SENT = {n: 2 * (n - 1) * (3 * P - ROOT_UNIT) // n for n in (8, 64)}  # FULL_SHARD, bf16, bytes per rank
NETWORK_S = {8: SENT[8] * 8 / 3600e9, 64: SENT[64] * 8 / 400e9}


def _plan(capsys, n: int, strategy: str = "FULL_SHARD") -> dict:
    assert main(["plan", "--model", "llama-7b", "--precision", "bf16", "--world-size", str(n), "--strategy",
                 strategy, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_the_hand_worked_numbers_are_the_chapters():
    assert (MATMUL, FLOPS, SENT[8], SENT[64]) == (6_607_077_376, 188_763_812_659_200, 34_917_922_816,
                                                   39_282_663_168)
    text = " ".join(CHAPTER.read_text().split())
    for figure in ("matmul parameters 6,607,077,376", "= 188,763,812,659,200", "/ 989e12 FLOP/s = 0.1909 s",
                   "= 34,917,922,816 bytes; x 8 bits / 3,600e9 bit/s = 0.0776 s",
                   "= 39,282,663,168 bytes; x 8 bits / 400e9 bit/s = 0.786 s", "34,917,922,816): SHARD_GRAD_OP",
                   "under the compute: HYBRID_SHARD, step >= 0.191 s"):
        assert figure in text, figure
    assert round(COMPUTE_S, 4) == 0.1909 and round(NETWORK_S[8], 4) == 0.0776 and round(NETWORK_S[64], 3) == 0.786


@pytest.mark.parametrize("n", [8, 64])
def test_network_and_compute_time_are_the_hand_worked_values(capsys, n):
    r = _plan(capsys, n)
    assert r["bytes_sent_per_rank_per_step"] == SENT[n]
    assert r["assumptions"]["flops_per_step"] == pytest.approx(FLOPS, rel=1e-9)
    assert r["compute_s"] == pytest.approx(COMPUTE_S, rel=1e-9)
    assert r["network_s"] == pytest.approx(NETWORK_S[n], rel=1e-9)
    assert r["step_time_lower_bound_s"] == pytest.approx(max(COMPUTE_S, NETWORK_S[n]), rel=1e-9)


def test_the_advice_is_the_hand_worked_one(capsys):
    assert _plan(capsys, 8)["advice"].startswith("SHARD_GRAD_OP is the fastest strategy that fits 8 x H100")
    r = _plan(capsys, 64)
    assert r["advice"].startswith("HYBRID_SHARD is the fastest strategy that fits 64 x H100")
    assert r["advice"].endswith(f"step >= {COMPUTE_S:.3g} s")
    hybrid = _plan(capsys, 64, "HYBRID_SHARD")
    shard = P // 8  # the all-reduce of each node's shard across 8 nodes, 2 bytes an element
    assert hybrid["network_s"] == pytest.approx(NETWORK_S[8] + 2 * 7 * shard * 2 // 8 * 8 / 400e9, rel=1e-9)
