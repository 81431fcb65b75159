"""The same script runs under torchrun: spawn() joins the env:// group instead of starting processes."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(180)
def test_spawn_under_torchrun(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(ROOT / "tests" / "_torchrun_script.py"), str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=170,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for rank in range(2):
        out = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert out == {"results": [101.0, 101.0], "world_size": 2}
