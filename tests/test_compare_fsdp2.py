"""``compare --impl fsdp2``, the ``ours_fsdp2`` bench row, and DCP checkpoints between ours and torch's FSDP2.

Oracle: torch's FSDP2, ``torch.distributed.fsdp.fully_shard``, applied the same way (every Block, then
the root) on the same seed and data.  Tolerance: bitwise at 2 ranks (each reduce-scatter sums two
numbers, which has one rounding; see minifsdp/training/compare.py), and checkpoints compare full tensors
with ``torch.equal``.
"""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from minifsdp.training.compare import _max_param_diff

ROOT = Path(__file__).resolve().parents[1]
ROW = re.compile(r"^\s+\d+\s+\d+\.\d+\s+\d+\.\d+\s+\S+$")


@pytest.mark.timeout(90)  # ~15 s on an idle 2-core laptop; the margin is for busy CI
def test_compare_impl_fsdp2_is_bitwise_with_torch_fully_shard(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "minifsdp", "compare", "--impl", "fsdp2", "--steps", "3", "--out", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=80,
    )
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    assert "minifsdp fully_shard vs torch fully_shard (FSDP2), FULL_SHARD" in out, out
    rows = [line for line in out.splitlines() if ROW.match(line)]
    assert len(rows) == 3, f"expected one table row per step:\n{out}"
    losses = [(float(r.split()[1]), float(r.split()[2])) for r in rows]
    assert losses[-1][0] < losses[0][0], f"the loss should fall over 3 AdamW steps: {losses}"
    assert all(r.split()[3] == "0" for r in rows), out
    assert "VERDICT: bitwise equal over 3 steps (ours vs torch, every rank)" in out, out
    assert (tmp_path / "compare_losses.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", "no loss-curve PNG"


@pytest.mark.timeout(120)  # a smoke test of the command (benchmarks are commands, not tests): ~20 s idle
def test_bench_fsdp_ours_fsdp2_row_is_read_against_torch_fsdp2(tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, "-m", "minifsdp", "bench", "fsdp", "--config", "tiny", "--world-sizes", "2",
         "--steps", "1", "--warmup", "0", "--batch-size", "1", "--trainers", "fsdp2,ours_fsdp2", "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=110,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [r["trainer"] for r in rows] == ["fsdp2", "ours_fsdp2"], rows
    torch2, ours2 = rows
    assert torch2["time_ratio_fsdp2"] == torch2["peak_ratio_fsdp2"] == 1.0
    assert ours2["time_ratio_fsdp2"] > 0 and ours2["peak_ratio_fsdp2"] > 0
    # model state at rest (exact, integers): the same per-parameter row shards, gradients and Adam state
    assert ours2["model_state_bytes"] == torch2["model_state_bytes"], rows
    assert "x FSDP2" in proc.stdout and "ours_fsdp2" in proc.stdout


def test_compare_impl_fsdp2_rejects_strategies_fsdp2_lacks():
    from minifsdp.commands.cli import main

    for strategy in ("NO_SHARD", "ddp"):
        with pytest.raises(SystemExit, match="--impl fsdp2 pairs our fully_shard with torch's"):
            main(["compare", "--impl", "fsdp2", "--strategy", strategy])


def test_param_diff_sees_one_changed_number_and_a_renamed_parameter():
    """The check behind the verdict: one number changed in one local shard is seen; so is a name mismatch."""

    class Local(torch.Tensor):  # stands in for a sharded parameter: has to_local()
        def to_local(self):
            return self.as_subclass(torch.Tensor)

    def model(names):
        m = nn.Module()
        for i, name in enumerate(names):
            m.register_parameter(name, nn.Parameter(torch.arange(6.0).view(3, 2) + i))
        return m

    a, b = model(["w", "v"]), model(["w", "v"])
    assert _max_param_diff(a, b) == 0.0
    with torch.no_grad():
        b.v[2, 1] += 2.0 ** -20
    assert _max_param_diff(a, b) == 2.0 ** -20
    a2, c = model(["w", "v"]), model(["w", "u"])
    for m in (a2, c):
        for name, p in list(m.named_parameters()):
            m.register_parameter(name, nn.Parameter(p.detach().as_subclass(Local)))
    with pytest.raises(RuntimeError, match="name their parameters differently"):
        _max_param_diff(a2, c)


@pytest.fixture(scope="module")
def dcp_result(tmp_path_factory):
    """One spawn of 2 ranks: ours saved -> torch FSDP2 loads, torch FSDP2 saved -> ours loads (rank 0's view)."""
    from minifsdp.launch import spawn
    from tests._workers_compare_fsdp2 import dcp_both_ways

    directory = tmp_path_factory.mktemp("dcp_fsdp2")
    return spawn(dcp_both_ways, args=(str(directory),), world_size=2, timeout_s=120)


def _all_equal(per_rank: list[dict], key: str) -> list[str]:
    """Names whose tensors differ on some rank (both ranks gather the same full tensors)."""
    return sorted({name for r in per_rank for name, same in r[key].items() if not same})


@pytest.mark.timeout(150)
def test_dcp_ours_saved_loads_into_torch_fully_shard(dcp_result):
    """Oracle: torch FSDP2's own ``dcp.load`` into its ``fully_shard`` model; every full tensor ``torch.equal``."""
    from minifsdp.models import GPTConfig, TinyGPT
    from tests._workers_compare_fsdp2 import CFG

    names = list(dcp_result[0]["to_torch_after"])
    assert names == [n for n, _ in TinyGPT(GPTConfig(**CFG), seed=0).named_parameters()]  # the tied head once
    assert _all_equal(dcp_result, "to_torch_before") == sorted(names), "the two models must start apart (seeds 0 and 1)"
    assert _all_equal(dcp_result, "to_torch_after") == []


@pytest.mark.timeout(150)
def test_dcp_torch_fully_shard_saved_loads_into_ours(dcp_result):
    """Oracle: torch FSDP2's ``dcp.save`` of its trained model; ours loads it; full tensors and local rows equal."""
    names = list(dcp_result[0]["from_torch_after"])
    assert _all_equal(dcp_result, "from_torch_before") == sorted(names), "the two models must start apart"
    assert _all_equal(dcp_result, "from_torch_after") == []
    assert _all_equal(dcp_result, "from_torch_locals") == []
    # 97 rows over 2 ranks: chunks of 49 and 48 rows, as torch.chunk
    assert [r["chunk_of_tok_emb"] for r in dcp_result] == [((49, 16), (97, 16)), ((48, 16), (97, 16))]
