"""Rank functions for tests/test_bench_harness.py (module level, so spawn can pickle them)."""

import os
import time

import torch.distributed as dist

from minifsdp.bench.harness import interleave


def slowest_rank_times(delay_s: float):
    """Rank 1's "ours" sleeps ``delay_s`` each round, rank 0's returns at once; "torch" returns at once on both.
    Returns what this rank's timings say, and the probe variable the parent set for the ranks."""
    slow = delay_s if dist.get_rank() == 1 else 0.0
    timings = interleave({"ours": lambda: time.sleep(slow), "torch": lambda: None}, rounds=2)
    return timings.wall, os.environ.get("BENCH_HARNESS_PROBE")


def torch_fails_on_rank_one():
    def torch_step():
        if dist.get_rank() == 1:
            raise RuntimeError("the reduce-scatter's output has the wrong shape")

    interleave({"ours": lambda: None, "torch": torch_step}, rounds=2)
