"""``--device cpu|cuda`` for the command-line jobs: where each local rank runs and what it talks over.

    --device cpu    every rank on the CPU, gloo                       (the default: a laptop)
    --device cuda   rank r on GPU r (under torchrun: LOCAL_RANK), NCCL; world size <= the GPUs present

Every job (compare, bench fsdp, train, generate) takes the option from here, so they check the same
things, in the parent before any rank starts, and refuse with the same words:

    parent   placement = resolve_device(args.device, world_size)    # DeviceError: what is wrong, and the fix
             spawn(worker, ..., backend=placement.backend)
    rank     device = rank_device(args.device)                      # torch.device("cuda", r): this rank's GPU
             model.to(device); torch's trainers get device_id=device too

Note (why the parent checks): a rank that finds no GPU fails after the others have started and
waits for it; the parent can say before anything starts that ``--world-size 2`` needs two GPUs.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from minifsdp.launch import launched_by_torchrun

__all__ = ["DEVICES", "DeviceError", "Placement", "add_device_argument", "resolve_device", "rank_device",
           "synchronize", "deterministic_cuda"]

DEVICES = ("cpu", "cuda")


class DeviceError(ValueError):
    """``--device`` cannot be honoured here; the message names the fix."""


@dataclass(frozen=True)
class Placement:
    """Where the ranks of a job run: ``device`` ("cpu" or "cuda") and the process group's ``backend``."""

    device: str
    backend: str
    gpus: int = 0  # GPUs visible to this process (cuda)

    def describe(self) -> str:
        """For the job's first line: "cpu, gloo" or "cuda (1 x NVIDIA H200), NCCL"."""
        if self.device == "cpu":
            return "cpu, gloo"
        return f"cuda ({self.gpus} x {torch.cuda.get_device_name(0)}), NCCL"


def add_device_argument(parser) -> None:
    """Add ``--device cpu|cuda`` (default cpu) to a job's argument parser."""
    parser.add_argument("--device", choices=DEVICES, default="cpu",
                        help="cpu: every rank on the CPU over gloo (default); cuda: rank r on GPU r over NCCL "
                             "(world size at most the GPUs present)")


def resolve_device(device: str, world_size: int = 1) -> Placement:
    """Check, in the parent, that ``world_size`` ranks can run on ``device``; return where and over what.

    Raises:
        DeviceError: an unknown device, ``cuda`` without a usable GPU, or more ranks than GPUs.
    """
    if device not in DEVICES:
        raise DeviceError(f"--device must be one of {', '.join(DEVICES)}, got {device!r}")
    if device == "cpu":
        return Placement("cpu", "gloo")
    if not torch.cuda.is_available():
        build = f"built with CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        raise DeviceError(f"--device cuda: no CUDA GPU is visible here (torch {torch.__version__}, {build}). "
                          "Run on a machine with an NVIDIA GPU and a CUDA build of torch, or use --device cpu.")
    gpus = torch.cuda.device_count()
    # Under torchrun the world spans machines: what must fit here is this machine's share of it.
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size)) if launched_by_torchrun() else world_size
    if local > gpus:
        raise DeviceError(f"--device cuda: {local} ranks on this machine need {local} GPUs (one per rank, NCCL), "
                          f"but {gpus} {'is' if gpus == 1 else 'are'} visible. Use a world size of at most "
                          f"{gpus}, or --device cpu.")
    return Placement("cuda", "nccl", gpus)


def rank_device(device: str) -> torch.device:
    """In a rank: its device.  ``cuda``: GPU ``LOCAL_RANK`` (torchrun) or the rank's index, made current."""
    if device != "cuda":
        return torch.device("cpu")
    if launched_by_torchrun():
        index = int(os.environ.get("LOCAL_RANK", 0))
    else:
        index = dist.get_rank() if dist.is_initialized() else 0
    index %= torch.cuda.device_count()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def synchronize(device: torch.device) -> None:
    """Wait for the GPU's queued work (a timed region must end there); nothing on the CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def deterministic_cuda() -> None:
    """Before CUDA starts (in the parent, so every rank inherits it): cuBLAS's workspace setting that makes its
    matmuls deterministic.  A rank then calls ``torch.use_deterministic_algorithms(True, warn_only=True)``:
    the two sides of a comparison run the same kernels, run to run."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
