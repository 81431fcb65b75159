"""The answers to tasks 2.1a-c (``exercises/fsdp_tasks.py``): FSDP's three core operations as small functions.

``minifsdp/fsdp/core/`` does these inside a unit, with hooks and buffers;
here each is one function of plain tensors, so a student can write it, and
the grading tests can check it against torch FSDP1 and a single process:

    2.1a  flatten_and_shard(tensors, rank, N)    the local shard of the flat parameter
          unflatten(flat, shapes)                 views of the full flat buffer, one per tensor
    2.1b  reduce_scatter_gradient(full_grad)      this rank's averaged gradient shard, bitwise torch FSDP1's
    2.1c  clip_grad_norm_sharded_(shards, max)    the global norm from shards, one all-reduce

    2.1a, 4 tensors of 3, 2, 4, 1 numbers, N = 4 (numel 10 -> padded to 12, shards of 3):

      flat    a a a | b b c | c c c | d 0 0
              rank 0  rank 1  rank 2  rank 3     rank 1 keeps [b b c]: shards cut through tensors

Note (the pre/post divide, 2.1b): torch FSDP1 averages a gradient over N
ranks as ``(sum_r g_r / f) / (N / f)`` with ``f = predivide_factor(N)``
(``minifsdp/fsdp/core/strategy.py``), not ``sum_r g_r / N``.  f is a power of two, so
dividing by it is exact (it only changes the exponent) and, as long as
nothing overflows, both forms give the same bits.  What f buys is range: the
sum of N gradients can overflow (in fp16 easily, in fp32 near 3.4e38) where
the sum of ``g_r / f`` does not.  Dividing by N *before* the sum is different
again: ``g_r / 3`` rounds on every rank.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

from minifsdp.comm import get_collectives
from minifsdp.comm.devices import collective_device
from minifsdp.fsdp.core.flat_param import padded_size, shard
from minifsdp.fsdp.core.gradient import finish_reduced_shard, reduction_input
from minifsdp.fsdp.core.strategy import predivide_factor
from minifsdp.fsdp.full_params import grad_norm

__all__ = ["flatten_and_shard", "unflatten", "reduce_scatter_gradient", "clip_grad_norm_sharded_"]


def flatten_and_shard(tensors: list[torch.Tensor], rank: int, world_size: int) -> torch.Tensor:
    """Task 2.1a (i): flatten ``tensors`` in order, pad with zeros to a multiple of N, return shard ``rank``.

    Returns a new 1-D tensor of ``ceil(total numel / N)`` numbers (it owns its memory).
    """
    if not tensors:
        raise ValueError("flatten_and_shard needs at least one tensor")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    flat = torch.cat([t.detach().reshape(-1) for t in tensors])
    pad = padded_size(flat.numel(), world_size) - flat.numel()
    return shard(F.pad(flat, [0, pad]), rank, world_size)


def unflatten(flat: torch.Tensor, shapes: list[torch.Size]) -> list[torch.Tensor]:
    """Task 2.1a (ii): views of ``flat`` (1-D, possibly padded at the end) in ``shapes``; no copy.

    One ``split`` then ``view`` each piece: gradients flowing into the views land in ``flat``'s gradient.
    """
    sizes = [math.prod(s) for s in shapes]
    if sum(sizes) > flat.numel():
        raise ValueError(f"shapes need {sum(sizes)} numbers, the flat buffer has {flat.numel()}")
    pieces = flat[: sum(sizes)].split(sizes)
    return [p.view(s) for p, s in zip(pieces, shapes)]


def reduce_scatter_gradient(full_grad: torch.Tensor, group=None) -> torch.Tensor:
    """Task 2.1b: this rank's shard of the gradient averaged over the group, as torch FSDP1 computes it.

    ``full_grad``: this rank's whole (unsharded, unpadded) 1-D flat gradient.  Pad it to a
    multiple of N, divide by ``f = predivide_factor(N)``, reduce-scatter (sum), divide by ``N / f``.
    Returns the ``ceil(numel / N)`` numbers of this rank's shard; ``full_grad`` is left unchanged.
    """
    n = dist.get_world_size(group)
    pre = predivide_factor(n)
    flat = full_grad.detach().reshape(-1).clone()  # a copy: the caller's gradient stays as is
    padded = reduction_input(flat, padded_size(flat.numel(), n), flat.dtype, pre)
    out = torch.empty(padded.numel() // n, dtype=full_grad.dtype, device=full_grad.device)
    get_collectives("torch").reduce_scatter(out, padded, group=group)  # torch's own, like FSDP1
    return finish_reduced_shard(out, n / pre, out.dtype)


def clip_grad_norm_sharded_(grad_shards: list[torch.Tensor], max_norm: float, group=None) -> torch.Tensor:
    """Task 2.1c: scale every shard in place by ``min(1, max_norm / (total + 1e-6))``; return ``total``.

    ``total`` is the L2 norm of the *whole* gradient: each rank sums the squares of its
    shards, one all-reduce adds the ranks' sums, the square root is taken on every rank.
    Computed as torch FSDP1 does (per-tensor norms in fp32, then their norm).
    """
    # The all-reduced number lives where the group's backend moves it (CPU on gloo, the GPU on a
    # plain "nccl" group), on a rank without shards too: a CPU zero would fail on NCCL.
    device = collective_device(group, like=grad_shards[0] if grad_shards else None)
    local = grad_norm(grad_shards, 2.0, device)  # torch FSDP1's: per-tensor norms in fp32, then their norm
    total_sq = local**2
    dist.all_reduce(total_sq, group=group)
    total = total_sq.sqrt()
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grad_shards:
        g.mul_(coef.to(g.device, g.dtype))
    return total
