"""Task 1.3's answer: each rank's slice of the data, cut as torch's ``DistributedSampler`` cuts it.

Read it after you are done (``exercises/README_launch.md`` has the task).  The oracle the tests use is
``torch.utils.data.DistributedSampler`` itself (``torch/utils/data/distributed.py``).
"""

from __future__ import annotations

import math

import torch


def rank_indices(dataset_len: int, rank: int, world_size: int, shuffle: bool = True, seed: int = 0,
                 epoch: int = 0, drop_last: bool = False) -> list[int]:
    """The dataset indices rank ``rank`` of ``world_size`` trains on in epoch ``epoch`` (see the stub)."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in [0, {world_size}): a job of {world_size} ranks numbers them "
                         f"0..{world_size - 1}")
    if shuffle:  # the same permutation on every rank: the seed and the epoch decide it, not the rank
        g = torch.Generator()
        g.manual_seed(seed + epoch)
        order = torch.randperm(dataset_len, generator=g).tolist()
    else:
        order = list(range(dataset_len))
    if drop_last and dataset_len % world_size:
        per_rank = math.ceil((dataset_len - world_size) / world_size)  # the largest multiple of N that fits
    else:
        per_rank = math.ceil(dataset_len / world_size)
    total = per_rank * world_size
    if drop_last:
        order = order[:total]
    elif order:  # pad with the first indices again (more than once if the dataset is smaller than the padding)
        order = (order * math.ceil(total / len(order)))[:total]
    return order[rank:total:world_size]  # interleaved: rank r takes every N-th index, from the r-th
