"""Rank functions for tests/test_launch.py (module level, so spawn can pickle them)."""

import os
import signal

import torch
import torch.distributed as dist


def rank_and_sum(offset):
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    return dist.get_rank(), dist.get_world_size(), t.item() + offset


def raise_on_rank_one():
    if dist.get_rank() == 1:
        raise ValueError("rank one is unhappy")
    t = torch.zeros(1)
    dist.recv(t, src=1)  # would wait forever if the parent did not end this rank


def kill_rank_one():
    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    t = torch.zeros(1)
    dist.recv(t, src=1)


def wait_for_a_message_never_sent():
    if dist.get_rank() == 0:
        t = torch.zeros(1)
        dist.recv(t, src=1)  # rank 1 never sends: the collective timeout must fire
    return "done"


def return_a_tensor():
    return torch.full((3,), float(dist.get_rank()))


def read_environment(name):
    return os.environ.get(name), torch.distributed.get_rank()
