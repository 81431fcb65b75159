"""tests/gpu: what needs CUDA, run where there is a GPU.

Everything in this folder is collected everywhere (so an import error shows up on a laptop too) and
skipped, with the reason, where there are fewer CUDA devices than a test needs: one, unless the test
is marked ``@pytest.mark.gpus(2)`` (two ranks, one GPU each: NCCL takes one GPU per rank).

    python -m pytest tests/gpu -q -rs       # one GPU: every one-GPU check runs; the 2-GPU ones say why they skip

The cuBLAS workspace setting makes its matmuls deterministic (it is read when cuBLAS starts, so it
is set before any test touches CUDA; spawned ranks inherit it).
"""

import os
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
DEFAULT_GPUS = 1

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")


def pytest_configure(config):
    config.addinivalue_line("markers", "gpus(n): the test needs n CUDA devices (tests/gpu; default 1)")


def gpus_needed(item) -> int:
    marker = item.get_closest_marker("gpus")
    return int(marker.args[0]) if marker is not None else DEFAULT_GPUS


def gpu_skip_reason(need: int = DEFAULT_GPUS) -> str | None:
    n = torch.cuda.device_count()
    if n >= need:
        return None
    what = "one GPU" if need == 1 else f"{need} GPUs (one per NCCL rank)"
    return (f"needs {what}; this machine has {n} CUDA device{'' if n == 1 else 's'} "
            f"(torch {torch.__version__}, CUDA available: {torch.cuda.is_available()})")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if HERE in Path(item.path).resolve().parents:
            reason = gpu_skip_reason(gpus_needed(item))
            if reason is not None:
                item.add_marker(pytest.mark.skip(reason=reason))
