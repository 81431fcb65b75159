"""What a resumed run needs besides the weights: the random number generators and the data position.

A run stopped at step k and resumed must take the *same* steps k+1, k+2, ...
as the run that never stopped.  The model and optimizer come back from the
checkpoint; two more things decide the next step:

    random state   torch's CPU generator (dropout, noise, randperm), CUDA's, Python's
                   ``random``, NumPy's: each rank has its own, so each rank saves its own
    data position  which batch comes next: here, the step number (our batches are a pure
                   function of (step, rank)); with a DataLoader, its sampler's epoch and offset

    extra = {"step": step, "rng": capture_rng()}           # per rank, passed to checkpoint.save
    ...
    extra = checkpoint.load(path, model, opt); restore_rng(extra["rng"]); start = extra["step"]

Note: under resharding (another world size) rank r's generator state has no
meaning for a rank that did not exist; ``checkpoint.load`` then returns rank 0's
``extra``, and a run that wants bitwise equality must resume at the same world size.
"""

from __future__ import annotations

import random

import torch

__all__ = ["capture_rng", "restore_rng"]


def capture_rng() -> dict:
    """Every generator this process uses, as picklable values."""
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np

        state["numpy"] = np.random.get_state()
    except ImportError:
        pass
    return state


def restore_rng(state: dict) -> None:
    """Put back what :func:`capture_rng` captured."""
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])
