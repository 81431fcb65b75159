"""The answers to tasks 2.3a-b and 2.4 (``exercises/memory_tasks.py``).

2.3a is the ZeRO paper's formula, written out (``minifsdp.memory.zero_formulas.model_state_bytes``, which the
library's plan and benches use for every recipe, computes it the same way); 2.3b and 2.4 count what our FSDP
holds and sends, exactly:

    2.3b  every unit padded to a multiple of N, then split: ceil(numel / N) numbers per rank, each 4 + 4 + 8
          bytes (parameter, gradient, AdamW's m and v in fp32), plus AdamW's 4-byte ``step`` per flat parameter
    2.4   a ring all-reduce of S numbers sends every chunk but its own in the reduce-scatter and every chunk
          but the next rank's in the all-gather (uneven chunks: the first S % N are one longer); an all-gather
          or a reduce-scatter of a padded unit sends (N - 1) / N of it
"""

from __future__ import annotations

import math

__all__ = ["model_state_bytes_per_rank", "fsdp_model_state_bytes_per_rank", "bytes_sent_per_rank"]

STRATEGIES = ("DDP", "FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD")


def model_state_bytes_per_rank(num_params: int, world_size: int, stage: int) -> float:
    """Task 2.3a: the ZeRO paper's mixed-precision Adam (2 + 2 + 12 bytes per parameter) under ``stage``."""
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage is 0 (DDP), 1, 2 or 3, got {stage!r}")
    # (bytes per parameter, the first stage that shards it): fp16 parameters, fp16 gradients, fp32 Adam state
    held = ((2, 3), (2, 2), (12, 1))
    return sum(size * num_params / (world_size if stage >= shards_from else 1) for size, shards_from in held)


def fsdp_model_state_bytes_per_rank(unit_numels: list[int], world_size: int) -> int:
    """Task 2.3b: the shards (padding included) x 16 bytes, plus 4 bytes of AdamW's ``step`` per unit."""
    units = list(unit_numels)
    return 16 * sum(math.ceil(n / world_size) for n in units) + 4 * len(units)


def _all_reduce_sent(numel: int, n: int, rank: int) -> int:
    """Numbers ``rank`` sends in a ring all-reduce of ``numel`` numbers cut in N uneven chunks."""
    base, extra = divmod(numel, n)
    size = [base + (1 if c < extra else 0) for c in range(n)]
    return 2 * numel - size[rank % n] - size[(rank + 1) % n]


def bytes_sent_per_rank(unit_numels: list[int], world_size: int, strategy: str, itemsize: int = 4,
                        rank: int = 0) -> int:
    """Task 2.4: bytes rank ``rank`` sends in one step (forward, backward, ``optimizer.step()``)."""
    units, n = list(unit_numels), world_size
    key = str(strategy).upper().replace("SHARDINGSTRATEGY.", "")
    if key not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; use one of {', '.join(STRATEGIES)}")
    if n == 1:
        return 0  # a ring of one sends nothing
    if key == "DDP":  # one bucket: the whole model all-reduced
        return _all_reduce_sent(sum(units), n, rank) * itemsize
    if key == "NO_SHARD":  # each unit all-reduced, unpadded
        return sum(_all_reduce_sent(u, n, rank) for u in units) * itemsize
    gather = [math.ceil(u / n) * (n - 1) * itemsize for u in units]  # (N-1)/N of each padded unit
    if key == "SHARD_GRAD_OP":  # one all-gather and one reduce-scatter per unit
        return 2 * sum(gather)
    return 3 * sum(gather) - gather[0]  # FULL_SHARD gathers again in the backward, all but the root
