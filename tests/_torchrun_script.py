"""Run by tests/test_launch_torchrun.py under torchrun: the same spawn() call, no code change."""

import json
import os
import sys

import torch
import torch.distributed as dist

import minifsdp


def total_of_ranks(offset):
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    return t.item() + offset


if __name__ == "__main__":
    results = minifsdp.spawn(total_of_ranks, args=(100.0,), world_size=2)
    with open(os.path.join(sys.argv[1], f"rank{os.environ['RANK']}.json"), "w") as f:
        json.dump({"results": results, "world_size": dist.get_world_size()}, f)
