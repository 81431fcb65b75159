"""minifsdp: Fully Sharded Data Parallel from scratch, proven against torch.

Chapters and the modules that build them:

    1    launch.py       local ranks (real processes on gloo)
    1    ddp.py          DataParallel and DistributedDataParallel from scratch
    2.2  collectives.py  naive and ring all-reduce, ring reduce-scatter / all-gather
         models.py       the tiny GPT and the MLP every chapter trains
"""

from minifsdp.launch import RankFailedError, spawn

__all__ = ["spawn", "RankFailedError"]
__version__ = "0.1.0"
