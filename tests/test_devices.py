"""``--device cpu|cuda`` on a machine without a GPU: the checks, the errors, and the GPU bench's code on the CPU.

What runs on a GPU is in ``tests/gpu`` (run there by ``tests/gpu/run_on_device.sh``); here:

* ``minifsdp.training.devices.resolve_device``: cpu is gloo; cuda is NCCL where there are enough GPUs, and
  a ``DeviceError`` that names the fix where there is no GPU or fewer GPUs than ranks (CUDA is faked
  with ``monkeypatch`` for the cases this machine cannot show);
* the command line turns that error into one line on stderr and exit status 2, before any rank starts;
* ``bench fsdp --device cuda``'s rank function, run on the CPU at one rank (its memory figures are
  CUDA's, zeros here): every trainer builds, steps and is timed, in fp32 and in bf16;
* ``tests/gpu`` is collected here and every test skips with its reason; the device script refuses
  to run without a GPU and says how to check it on a CPU.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import minifsdp
from minifsdp.bench import fsdp_cuda as bench_fsdp_cuda
from minifsdp.commands.cli import main
from minifsdp.training.devices import DeviceError, Placement, resolve_device

ROOT = Path(__file__).resolve().parents[1]
NO_GPU = pytest.mark.skipif(torch.cuda.is_available(), reason="checks what a machine without a GPU says")


def _fake_gpus(monkeypatch, n: int) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)


def test_cpu_is_gloo_at_any_world_size():
    assert resolve_device("cpu", 4) == Placement("cpu", "gloo")


def test_cuda_is_nccl_with_a_gpu_per_rank(monkeypatch):
    _fake_gpus(monkeypatch, 2)
    assert resolve_device("cuda", 2) == Placement("cuda", "nccl", gpus=2)
    assert resolve_device("cuda", 1).backend == "nccl"


def test_more_ranks_than_gpus_names_the_fix(monkeypatch):
    _fake_gpus(monkeypatch, 1)
    with pytest.raises(DeviceError, match=r"2 ranks on this machine need 2 GPUs .* but 1 is visible. Use a world "
                                          r"size of at most 1, or --device cpu"):
        resolve_device("cuda", 2)


def test_under_torchrun_only_this_machines_ranks_need_gpus(monkeypatch):
    _fake_gpus(monkeypatch, 2)
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("MASTER_ADDR", "node0")
    monkeypatch.setenv("MASTER_PORT", "29500")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert resolve_device("cuda", 8).backend == "nccl"  # 8 ranks on 4 machines of 2 GPUs
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    with pytest.raises(DeviceError, match="4 ranks on this machine need 4 GPUs"):
        resolve_device("cuda", 8)


def test_no_gpu_and_unknown_devices_are_refused(monkeypatch):
    _fake_gpus(monkeypatch, 0)
    with pytest.raises(DeviceError, match=r"no CUDA GPU is visible here .* or use --device cpu"):
        resolve_device("cuda", 1)
    with pytest.raises(DeviceError, match="--device must be one of cpu, cuda"):
        resolve_device("tpu", 1)


@NO_GPU
@pytest.mark.parametrize("argv", (["compare", "--device", "cuda", "--world-size", "1"],
                                  ["bench", "fsdp", "--device", "cuda", "--config", "tiny", "--world-sizes", "1"],
                                  ["train", "--device", "cuda", "--world-size", "1", "--steps", "2"],
                                  ["generate", "--device", "cuda", "--checkpoint", ".", "--prompt", "x"]))
def test_cli_without_a_gpu_says_so_in_one_line(capsys, argv):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"minifsdp {argv[0]}: error: --device cuda: no CUDA GPU is visible here"), err
    assert "--device cpu" in err and "Traceback" not in err


def test_cli_refuses_what_cuda_cannot_do(capsys, monkeypatch):
    _fake_gpus(monkeypatch, 2)  # enough GPUs: the other checks speak
    assert main(["compare", "--device", "cuda", "--world-size", "2", "--collectives", "ring"]) == 2
    assert "--collectives ring is our ring on gloo's CPU tensors" in capsys.readouterr().err
    assert main(["bench", "fsdp", "--precision", "bf16"]) == 2  # the CPU bench stays as the book quotes it
    assert "--precision are for bench fsdp --device cuda" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="--trainers .*unknown.*ours_ring"):
        main(["bench", "fsdp", "--device", "cuda", "--trainers", "fsdp1,ours_ring"])
    with pytest.raises(SystemExit, match="--config: unknown.*'1b'"):
        main(["bench", "fsdp", "--device", "cuda", "--config", "85m,1b"])


def test_gpu_bench_configs_are_the_measured_sizes():
    with torch.device("meta"):  # shapes only
        sizes = {name: sum(p.numel() for p in minifsdp.TinyGPT(bench_fsdp_cuda.CONFIGS[name]()).parameters())
                 for name in ("85m", "300m")}
    assert sizes == {"85m": 85_522_944, "300m": 303_458_304}, sizes
    c = bench_fsdp_cuda.CONFIGS["300m"]()
    assert (c.n_layer, c.n_embd, c.block_size, c.vocab_size) == (24, 1024, 1024, 96)
    assert bench_fsdp_cuda.DEFAULTS["85m"]["batch_size"] == 16 and bench_fsdp_cuda.DEFAULTS["300m"]["batch_size"] == 8


@pytest.mark.timeout(180)  # about 15 s on an idle 2-core machine
def test_gpu_bench_rank_runs_every_trainer_on_the_cpu():
    """The rank function ``bench fsdp --device cuda`` spawns, at one rank on the CPU, in bf16 (autocast for plain
    and DDP, MixedPrecision / MixedPrecisionPolicy for the FSDPs): each trainer built, stepped and timed."""
    names = list(bench_fsdp_cuda.TRAINERS)
    results = minifsdp.spawn(bench_fsdp_cuda.bench_rank, args=("tiny", "bf16", names, 2, 1, 2, "cpu"),
                             world_size=1, timeout_s=150)
    rows = bench_fsdp_cuda.summarize(1, "tiny", "bf16", results, names)
    assert [r["trainer"] for r in rows] == names
    ref = next(r for r in rows if r["trainer"] == "fsdp1")
    assert ref["time_ratio"] == 1.0
    for r in rows:
        assert len(r["step_times_s"]) == 2 and all(t > 0 for t in r["step_times_s"]), r
        assert [(p["step"], p["phase"]) for p in r["memory_rank0"]] == [(None, "wrap")] + [
            (s, ph) for s in range(2) for ph in bench_fsdp_cuda.PHASES]
    table = bench_fsdp_cuda.format_table(rows)
    summary = bench_fsdp_cuda.format_summary(rows + [{"config": "300m", "precision": "fp32", "world_size": 1,
                                                      "error": "rank 0 failed:\nOutOfMemoryError: ..."}], names)
    assert "x FSDP1" in table and "ms" in summary.splitlines()[2]
    assert summary.splitlines()[-1] == "300m fp32 N=1: FAILED (OutOfMemoryError: ...)"


@NO_GPU
@pytest.mark.timeout(120)
def test_gpu_suite_is_collected_here_and_says_why_it_skips():
    proc = subprocess.run([sys.executable, "-m", "pytest", "tests/gpu", "-q", "-rs", "-p", "no:cacheprovider"],
                          cwd=ROOT, capture_output=True, text=True, timeout=110)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and " skipped" in out and "passed" not in out and "error" not in out.lower(), out
    assert "needs one GPU; this machine has 0 CUDA devices" in out, out
    assert "needs 2 GPUs (one per NCCL rank)" in out, out


@NO_GPU
@pytest.mark.timeout(120)
def test_device_script_refuses_to_run_without_a_gpu(tmp_path):
    script = ROOT / "tests" / "gpu" / "run_on_device.sh"
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    env = {**os.environ, "OUT": str(tmp_path / "out"), "PYTHON": sys.executable}
    env.pop("DEVICE", None)
    proc = subprocess.run(["bash", str(script)], cwd=ROOT, capture_output=True, text=True, timeout=110, env=env)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "NO CUDA GPU visible" in proc.stdout and "DEVICE=cpu bash tests/gpu/run_on_device.sh" in proc.stdout
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["env.txt", "summary.txt"]
