"""Task 1.3: which samples each rank trains on, as torch's ``DistributedSampler`` decides it.

Fill in :func:`rank_indices`; the task text and hints are in ``exercises/README_launch.md``.
Grade yourself with::

    pytest tests/exercises --impl=student -k task1_3
"""

from __future__ import annotations


def rank_indices(dataset_len: int, rank: int, world_size: int, shuffle: bool = True, seed: int = 0,
                 epoch: int = 0, drop_last: bool = False) -> list[int]:
    """The dataset indices rank ``rank`` of ``world_size`` trains on in epoch ``epoch``.

    Exactly what ``torch.utils.data.DistributedSampler(dataset, num_replicas=world_size, rank=rank,
    shuffle=shuffle, seed=seed, drop_last=drop_last)`` yields after ``set_epoch(epoch)``: every rank gets
    the same number of indices, and the ranks' slices together cover the dataset.

    Raises:
        ValueError: ``rank`` is not in ``[0, world_size)``.
    """
    raise NotImplementedError("Task 1.3: rank_indices -- see exercises/README_launch.md")
