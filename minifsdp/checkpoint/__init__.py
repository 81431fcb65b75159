"""Chapter 4.3: checkpoints of a sharded model, loadable at any world size, and bitwise resume.

After ``from minifsdp import checkpoint``:

    checkpoint.save("run/step_10", model, opt, extra={"step": 10})   # every rank (collective)
    extra = checkpoint.load("run/step_10", model, opt)

    save_load.py    save / load: sharded (every rank its pieces) or full (one file on rank 0)
    pieces.py       the idea that makes resharding work: save each parameter's own numbers, not flat shards
    state_dicts.py  full and sharded state dicts of the model and the optimizer
    files.py        atomic files, a checksummed manifest; CheckpointError
    manager.py      CheckpointManager: the newest K checkpoints of a run
    dcp.py          to and from torch.distributed.checkpoint (torch FSDP2's format)
    resume.py       RNG states and data position, for a resume that is bitwise the run that never stopped
"""

from minifsdp.checkpoint.files import CheckpointError, read_manifest
from minifsdp.checkpoint.manager import CheckpointManager
from minifsdp.checkpoint.save_load import FULL_FILE, load, save
from minifsdp.checkpoint.state_dicts import (
    full_optim_state_dict,
    full_state_dict,
    load_full_optim_state_dict,
    sharded_state_dict,
)

__all__ = ["save", "load", "full_state_dict", "sharded_state_dict", "full_optim_state_dict",
           "load_full_optim_state_dict", "CheckpointError", "CheckpointManager", "read_manifest", "FULL_FILE"]
