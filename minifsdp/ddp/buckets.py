"""Gradient buckets: how DDP groups many small gradients into a few big messages.

Why buckets?  A model has many parameters (the tiny GPT has 30 tensors, a real
one thousands).  One all-reduce per tensor pays the fixed latency of a
collective thousands of times; one all-reduce for the whole model must wait
until *every* gradient exists, so nothing overlaps with backward.  Buckets are
the middle ground: a bucket is a flat buffer of about ``bucket_cap_mb``; it is
sent as soon as all of its gradients are ready, while backward goes on
computing the gradients of the layers below it.

Which parameters share a bucket?  Backward produces gradients roughly in the
*reverse* order the parameters were registered (the last layer's first), so we
walk the parameters from last to first and cut a new bucket whenever the open
one is full:

    registration order:  p0  p1  p2  p3  p4  p5        (p5 = last layer)
    gradient ready:      p5, p4, p3, p2, p1, p0   (roughly)
    buckets (cap = 3 tensors' worth):
        bucket 0: [p5, p4, p3]   <- ready first, sent first, overlaps backward of p2..p0
        bucket 1: [p2, p1, p0]   <- sent when backward is (almost) done

A bucket is one flat tensor; each gradient owns a contiguous slice of it:

    bucket.flat:  | p5 (numel 8) | p4 (numel 64) | p3 (numel 8) |
                  0              8               72             80

Note (the cutting rule, as torch's Reducer): a parameter is *added* to the
open bucket first, then the bucket is closed if it now holds at least
``bucket_cap_bytes``.  So a bucket can overshoot the cap by one parameter, and
a parameter bigger than the cap closes the bucket it lands in.  Parameters of
different dtypes (or devices) never share a flat buffer; each (dtype, device)
has its own open bucket, as in torch's ``compute_bucket_assignment_by_size``.

Note (torch rebuilds its buckets): torch's DDP, by default, puts *all*
parameters into one bucket for the first iteration, records the order in which
gradients actually became ready, and then rebuilds its buckets in that order
(with a small 1 MiB first bucket when ``bucket_cap_mb`` is left at its default).
We use the reverse registration order from the start: simpler, and it lets
the very first backward overlap too.  ``DistributedDataParallel(...,
bucket_layout="torch")`` replays torch's two phases exactly (``fill_buckets``
with the recorded order), which is what bitwise parity at 3+ ranks needs.
"""

from __future__ import annotations

import torch

__all__ = ["assign_buckets", "fill_buckets", "Bucket"]


def assign_buckets(params, bucket_cap_bytes: int) -> list[list[int]]:
    """Group parameters into buckets; returns lists of indices into ``params``.

    Args:
        params: a sequence of tensors in registration order (``model.parameters()``).
        bucket_cap_bytes: close a bucket once it holds at least this many bytes.

    Returns:
        buckets in the order they will be sent; each lists parameter indices in
        reverse registration order.  Example with three 400-byte tensors and a
        cap of 800 bytes: ``[[2, 1], [0]]``.
    """
    return fill_buckets(params, reversed(range(len(params))), [bucket_cap_bytes])


def fill_buckets(params, order, caps: list[int]) -> list[list[int]]:
    """The general rule: visit ``params`` in ``order``; the k-th bucket closes at ``caps[k]`` bytes.

    ``caps`` lists per-bucket caps, the last one repeating (torch uses
    ``[1 MiB, 25 MiB]``: a small first bucket so the first all-reduce starts early).
    ``assign_buckets`` is ``order = last to first, caps = [cap]``.
    """
    if any(c <= 0 for c in caps) or not caps:
        raise ValueError(f"bucket caps must be positive, got {caps}; use e.g. 25 * 2**20 (25 MiB).")
    buckets: list[list[int]] = []
    open_buckets: dict[tuple, tuple[list[int], int]] = {}  # (dtype, device) -> (indices, bytes)
    closed_per_key: dict[tuple, int] = {}
    for i in order:
        p = params[i]
        key = (p.dtype, p.device)
        indices, size = open_buckets.get(key, ([], 0))
        indices.append(i)
        size += p.numel() * p.element_size()
        n_closed = closed_per_key.get(key, 0)
        if size >= caps[min(n_closed, len(caps) - 1)]:
            buckets.append(indices)  # full: it will be sent in this position
            open_buckets.pop(key, None)
            closed_per_key[key] = n_closed + 1
        else:
            open_buckets[key] = (indices, size)
    buckets.extend(indices for indices, _ in open_buckets.values())  # the partly filled ones, last
    return buckets


class Bucket:
    """One flat buffer holding the gradients of a few parameters, and its bookkeeping.

    ``flat`` has ``sum(p.numel())`` elements; ``view(k)`` is the slice of the
    k-th parameter of this bucket, shaped like that parameter.
    """

    def __init__(self, index: int, param_indices: list[int], params: list[torch.Tensor]):
        self.index = index
        self.param_indices = param_indices
        self.params = [params[i] for i in param_indices]
        self.offsets: list[int] = []
        total = 0
        for p in self.params:
            self.offsets.append(total)
            total += p.numel()
        self.flat = torch.zeros(total, dtype=self.params[0].dtype, device=self.params[0].device)
        self.pending = len(self.params)  # gradients still to arrive in this backward
        self.handle = None  # the in-flight all-reduce, if any

    @property
    def nbytes(self) -> int:
        return self.flat.numel() * self.flat.element_size()

    def view(self, k: int) -> torch.Tensor:
        p = self.params[k]
        return self.flat[self.offsets[k] : self.offsets[k] + p.numel()].view(p.shape)

    def reset(self) -> None:
        self.pending = len(self.params)
        self.handle = None

    def copy_grads_out(self) -> None:
        """After the all-reduce: every parameter's ``.grad`` becomes its (averaged) slice."""
        for k, p in enumerate(self.params):
            p.grad.copy_(self.view(k))
