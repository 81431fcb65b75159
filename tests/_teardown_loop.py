"""Run notebook 01's train_ddp.py under torchrun again and again; count the runs that fail.

The notebook's last cell writes the script from chapter 01 (the block after the marker
below) into a temporary folder and runs it with ``torchrun --standalone --nproc-per-node 2``.
A rank that aborts at exit (``terminate called without an active exception``, exit code -6)
fails that cell in 4 of 60 runs on a busy 2-core machine when the launcher leaves
work behind in a gloo thread (see ``minifsdp.launch._gather_through_store``).

    python -m tests._teardown_loop 30          # the proof: 30 runs, 0 failures expected

tests/test_teardown.py runs it 3 times, which CI can afford.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MARKER = "<!-- notebook 01 runs the next block as train_ddp.py -->"


def train_ddp_script() -> str:
    """The script notebook 01 runs, taken from the chapter exactly as the notebook takes it."""
    chapter = (ROOT / "chapters" / "01_parallel_training_overview.md").read_text(encoding="utf-8")
    return re.search(r"```python\n(.*?)```", chapter[chapter.index(MARKER):], re.S).group(1)


@dataclass
class Run:
    returncode: int
    stdout: str
    stderr: str

    @property
    def failed(self) -> bool:
        return self.returncode != 0 or "terminate called" in self.stderr


def run_once(workdir: Path, timeout_s: float = 300) -> Run:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "train_ddp.py"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # The script imports minifsdp: this checkout's, even where it is not installed.
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    proc = subprocess.run(cmd, cwd=workdir, env=env, capture_output=True, text=True, timeout=timeout_s)
    return Run(proc.returncode, proc.stdout, proc.stderr)


def run_loop(n: int, verbose: bool = False) -> list[Run]:
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        (workdir / "train_ddp.py").write_text(train_ddp_script())
        runs = []
        for i in range(n):
            runs.append(run_once(workdir))
            if verbose:
                r = runs[-1]
                note = "FAILED " + (r.stderr.strip().splitlines() or ["(no stderr)"])[0] if r.failed else "ok"
                print(f"run {i + 1}/{n}: exit {r.returncode} {note}", flush=True)
        return runs


if __name__ == "__main__":
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 30
    runs = run_loop(n, verbose=True)
    failures = sum(r.failed for r in runs)
    print(f"{failures} failures in {n} runs")
    sys.exit(1 if failures else 0)
