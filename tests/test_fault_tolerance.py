"""A rank that dies mid-training: torchrun restarts the job from the last checkpoint; spawn reports it.

Oracle for the restart: the same job under ``minifsdp.spawn`` with no failure.  The
restarted job must end with bitwise the same parameters, and its steps after the
resume must have bitwise the same losses (the RNG and data position came back).
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import minifsdp
from minifsdp.launch import RankFailedError
from tests import _train_resumable as job

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(240)
def test_torchrun_restarts_from_the_last_checkpoint_after_a_sigkill(tmp_path):
    oracle = minifsdp.spawn(job.train, args=(str(tmp_path / "oracle"),), world_size=2, timeout_s=120)[0]
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "--max-restarts", "1", str(ROOT / "tests" / "_train_resumable.py"), str(tmp_path / "job"),
         "--kill-at", "5"],
        cwd=ROOT, capture_output=True, text=True, timeout=200,
    )
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-6000:]
    assert (tmp_path / "job" / "killed_once").exists(), "rank 1 was never killed: the test tested nothing"
    assert "failed (exitcode: -9) local_rank: 1" in log, log[-6000:]  # torchrun saw rank 1 die by SIGKILL
    got = torch.load(tmp_path / "job" / "result.pt", weights_only=False)
    assert got["restarts"] == 1 and got["resumed_from"] == 4
    assert got["losses"] == {s: oracle["losses"][s] for s in range(4, job.STEPS)}
    assert sorted(got["full"]) == sorted(oracle["full"])
    for k in oracle["full"]:
        assert np.array_equal(got["full"][k], oracle["full"][k]), k
    assert got["kept"] == [6, 8]  # keep=2, and the interrupted attempt left nothing half-written behind


@pytest.mark.timeout(120)
def test_spawn_names_the_rank_killed_mid_training_and_ends_the_others(tmp_path):
    t0 = time.monotonic()
    with pytest.raises(RankFailedError, match="SIGKILL") as info:
        minifsdp.spawn(job.train, args=(str(tmp_path), 1), world_size=2, timeout_s=60)
    assert info.value.rank == 1
    assert time.monotonic() - t0 < 50, "rank 0 (blocked in a collective) should have been ended, not waited for"
