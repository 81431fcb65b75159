"""Chapter 1: data parallelism before sharding.

    data_parallel.py  torch.nn.DataParallel's recipe by hand (one process, N replicas) and its bottleneck
    buckets.py        which gradients travel together in one all-reduce
    distributed.py    DistributedDataParallel from scratch: gradient hooks, buckets, overlap, no_sync
"""

from minifsdp.ddp.buckets import assign_buckets
from minifsdp.ddp.data_parallel import DataParallel
from minifsdp.ddp.distributed import DDP, DistributedDataParallel

__all__ = ["DataParallel", "DistributedDataParallel", "DDP", "assign_buckets"]
