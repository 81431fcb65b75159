"""Which devices a process group's backend moves tensors on, and where a small control tensor must live.

gloo moves CPU tensors (and CUDA ones, through the host); NCCL moves CUDA tensors only; a mixed
group ("cpu:gloo,cuda:nccl") picks the backend by the tensor's device.  DDP's and FSDP's checks,
a clipping norm, a scaler's inf flag: each small tensor a collective carries must be made where
the backend takes it, the same on every rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["backend_devices", "collective_device", "check_backend_supports"]


def _name(group) -> str:
    """The backend's name: ``group`` itself if it is one, else ``dist.get_backend(group)``."""
    return group if isinstance(group, str) else str(dist.get_backend(group))


def backend_devices(group=None) -> list[str]:
    """The device types that ``group``'s backend runs collectives on.

    ``group``: a process group, None (the default group), or a backend name as
    ``init_process_group`` takes it.  "gloo" -> ["cpu", "cuda"]; "nccl" -> ["cuda"];
    "cpu:gloo,cuda:nccl" -> ["cpu", "cuda"] (torch's ``Backend.backend_capability``
    for a single backend, the "device:backend" pairs for a mixed one).
    """
    backend = _name(group).lower()
    if ":" in backend:
        return [pair.split(":")[0].strip() for pair in backend.split(",")]
    return list(dist.Backend.backend_capability.get(backend, ["cpu"]))


def collective_device(group=None, like: torch.Tensor | None = None) -> torch.device:
    """Where a small control tensor (a checksum, a flag, a norm) must live to go through ``group``.

    CPU whenever the group has a CPU backend (gloo, or the "cpu:" half of a mixed group):
    the value is read in Python right after, so it saves a device copy, and a run on
    gloo stays exactly what it was.  Otherwise (a plain "nccl" group) the device of
    ``like`` (the module's parameters) if the backend takes it, else the current CUDA device,
    as torch's own object collectives choose (``distributed_c10d._get_object_coll_device``).
    """
    kinds = backend_devices(group)
    if "cpu" in kinds:
        return torch.device("cpu")
    if like is not None and like.device.type in kinds:
        return like.device
    if "cuda" in kinds and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    raise RuntimeError(f"no device for a collective on backend {_name(group)!r} "
                       f"(it runs on {kinds}); is this process's GPU visible?")


def check_backend_supports(group, tensors, who: str) -> None:
    """Raise a clear error if a module tensor sits on a device ``group``'s backend cannot send (CPU on NCCL)."""
    kinds = backend_devices(group)
    for device in dict.fromkeys(t.device for t in tensors):
        if device.type not in kinds:
            raise ValueError(
                f"{who}: the module is on {device}, but the process group's backend "
                f"{_name(group)!r} moves only {'/'.join(kinds)} tensors. Move the module to this "
                "rank's GPU first (module.to(torch.cuda.current_device())), or init the group with "
                "backend='cpu:gloo,cuda:nccl' (or 'gloo') to train on CPU."
            )
