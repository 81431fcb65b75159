"""Rank functions for chapter 6's tests: each pitfall on torch's FSDP and on ours, in the same ranks.

The reproductions live in the library (``minifsdp/cells/pitfall_runs.py``: chapter 6's explorer runs them
too).  ``pitfalls_worker`` runs every case that cannot hang in one 2-rank spawn and returns a dict of small,
picklable facts; ``wrap_disagreement_worker`` runs the one case that hangs when its check is missing, in a
spawn of its own with a short timeout.  Torch's side records what torch does (the oracle for "silently");
ours records the error or warning, and that the correct program stays silent and trains as torch's does.
"""

from __future__ import annotations

import functools

import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from minifsdp import FSDP, MLP
from minifsdp.cells.pitfall_runs import (
    clip_cases,
    error_of,
    frozen_cases,
    hybrid_cases,
    load_cases,
    optimizer_cases,
    small_tensor_cases,
    torch_dcp_cases,
    warnings_of,
)
from minifsdp.fsdp.torch_options import size_based_auto_wrap_policy


def pitfalls_worker() -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    return {"optimizer": optimizer_cases(rank, world, mesh), "load": load_cases(rank, world),
            "hybrid": hybrid_cases(rank, world), "clip": clip_cases(rank, world),
            "frozen": frozen_cases(rank, world), "small_tensor": small_tensor_cases(rank, world),
            "dcp": torch_dcp_cases(rank, world)}


def wrap_disagreement_worker() -> dict:
    """Rank 0 wraps each Linear of 500+ parameters on its own, rank 1 the model whole (a setting one rank read
    differently).  Ours must raise on both ranks, naming each; then the same wrap on every rank stays silent."""
    rank = dist.get_rank()
    policy = functools.partial(size_based_auto_wrap_policy, min_num_params=500)
    out = {"disagree": error_of(lambda: FSDP(MLP(), auto_wrap_policy=policy if rank == 0 else None))}
    (m, seen) = warnings_of(lambda: FSDP(MLP(), auto_wrap_policy=policy))
    out["agree_units"], out["agree_warnings"] = len(FSDP.fsdp_modules(m)), seen
    return out


def explorer_oracle_worker() -> dict:
    """Chapter 6's explorer's two pitfalls, run by calling the library's reproductions directly."""
    rank, world = dist.get_rank(), dist.get_world_size()
    return {"clip": clip_cases(rank, world), "hybrid": hybrid_cases(rank, world)}
