"""The answers to tasks 4.4a-b (``exercises/parallel_tasks.py``).

4.4a: the forward of Megatron's row-parallel Linear, N ranks simulated in one process, with the math of our
``RowwiseParallel`` (``minifsdp/parallel/tensor_parallel.py``): rank r multiplies its slice of the input's
last dimension by the same columns of the weight, the all-reduce sums the partials in rank order, and the
whole bias is added once, after the sum.  4.4b: stage s of S runs S - s - 1 warm-up forwards (what it can
start before the first backward comes back to it), then a forward and a backward in turn, then the backwards
left, with the checks torch's ``Schedule1F1B`` makes (``minifsdp/parallel/pipeline_schedules.py`` runs it).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["row_parallel_linear", "one_f_one_b_order"]


def row_parallel_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                        world_size: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Task 4.4a: ``(partials, outputs)``, one of each per rank."""
    in_features = weight.shape[1]
    if in_features % world_size:
        raise ValueError(f"in_features={in_features} is not divisible by world_size={world_size}")
    k = in_features // world_size
    partials = [F.linear(x[..., r * k:(r + 1) * k].contiguous(), weight[:, r * k:(r + 1) * k].contiguous())
                for r in range(world_size)]
    total = partials[0].clone()
    for p in partials[1:]:
        total = total + p  # the all-reduce, in rank order
    out = total if bias is None else total + bias  # the whole bias, once, after the sum
    return partials, [out.clone() for _ in range(world_size)]


def one_f_one_b_order(stage_index: int, num_stages: int, n_microbatches: int) -> list[str]:
    """Task 4.4b: the actions of stage ``stage_index`` in one 1F1B step, in order."""
    if not 0 <= stage_index < num_stages:
        raise ValueError(f"stage_index {stage_index} not in 0..{num_stages - 1}")
    if n_microbatches < num_stages:
        raise ValueError(f"1F1B needs n_microbatches >= num_stages, got {n_microbatches} < {num_stages}")
    warmup = num_stages - stage_index - 1
    order = [f"F{m}" for m in range(warmup)]
    for m in range(n_microbatches - warmup):
        order += [f"F{warmup + m}", f"B{m}"]  # steady state: the next forward, then the oldest backward
    return order + [f"B{m}" for m in range(n_microbatches - warmup, n_microbatches)]
