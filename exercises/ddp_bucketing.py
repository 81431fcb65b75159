"""Task 1.1: put DDP's gradients into buckets.

Fill in :func:`assign_buckets`; the task text and hints are in
``exercises/README_ddp.md``.  Grade yourself with::

    pytest tests/exercises/test_ddp_exercises.py --impl=student
"""

from __future__ import annotations


def assign_buckets(params, bucket_cap_bytes: int) -> list[list[int]]:
    """Group parameters into buckets, the way DistributedDataParallel does.

    Args:
        params: tensors in registration order (as ``list(model.parameters())``);
            a parameter's size in bytes is ``p.numel() * p.element_size()``.
        bucket_cap_bytes: a bucket is closed as soon as it holds at least this many bytes.

    Returns:
        a list of buckets, in the order they are sent; each bucket is a list of
        indices into ``params``.  Walk the parameters from the LAST to the FIRST.
        Example: three 400-byte tensors, cap 800 -> ``[[2, 1], [0]]``.
    """
    raise NotImplementedError("Task 1.1: assign_buckets -- see exercises/README_ddp.md")
