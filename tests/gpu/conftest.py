"""tests/gpu: the NCCL path, run only where there are at least 2 CUDA devices.

Everything in this folder is collected everywhere (so an import error shows up on
a laptop too) and skipped, with the reason, unless ``torch.cuda.device_count() >= 2``:
the parity runs need one GPU per rank on a plain "nccl" group.

    python -m pytest tests/gpu -q        # on a machine with 2+ GPUs

The cuBLAS workspace setting makes its matmuls deterministic (it is read when
cuBLAS starts, so it is set before any test touches CUDA; spawned ranks inherit it).
"""

import os
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
MIN_GPUS = 2

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")


def gpu_skip_reason() -> str | None:
    n = torch.cuda.device_count()
    if n >= MIN_GPUS:
        return None
    return (f"tests/gpu needs at least {MIN_GPUS} CUDA devices (one per NCCL rank); "
            f"this machine has {n} (torch {torch.__version__}, CUDA available: {torch.cuda.is_available()})")


def pytest_collection_modifyitems(config, items):
    reason = gpu_skip_reason()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=reason)
    for item in items:
        if HERE in Path(item.path).resolve().parents:
            item.add_marker(skip)
