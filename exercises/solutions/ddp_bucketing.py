"""The answer to task 1.1 (``exercises/ddp_bucketing.py``), written out: DDP's bucketing rule, as
``minifsdp.ddp.buckets.assign_buckets`` (which our DDP runs) applies it.

Walk the parameters from the last to the first; each (dtype, device) has one open bucket; a bucket closes (and
takes its place in the send order) as soon as it holds at least the cap; the ones still open go last, in the
order they were opened.
"""

__all__ = ["assign_buckets"]


def assign_buckets(params, bucket_cap_bytes: int) -> list[list[int]]:
    """Task 1.1: lists of indices into ``params``, in the order they are sent."""
    if bucket_cap_bytes <= 0:
        raise ValueError(f"the bucket cap must be positive, got {bucket_cap_bytes}")
    sent: list[list[int]] = []
    filling: dict[tuple, list] = {}  # (dtype, device) -> [indices, bytes so far]
    for index in range(len(params) - 1, -1, -1):
        p = params[index]
        kind = (p.dtype, p.device)
        entry = filling.setdefault(kind, [[], 0])
        entry[0].append(index)
        entry[1] += p.numel() * p.element_size()
        if entry[1] >= bucket_cap_bytes:
            sent.append(filling.pop(kind)[0])
    return sent + [indices for indices, _ in filling.values()]
