"""Run by tests/test_teardown.py under torchrun: what spawn leaves behind, and what exit leaves behind.

Writes rank<r>.json into the folder given as argv[1]:
  * seq_after_fn / seq_after_spawn: the group's collective counter when ``fn`` returned and when
    ``spawn`` returned.  Equal means spawn's gather issued no collective on the group, so no gloo
    worker thread is left holding its tensors when the script ends.
  * streams_after_spawn: our comm-stream threads alive after spawn (fn ran ring collectives).
  * at_exit: written by an atexit hook that runs after minifsdp's teardown (atexit is last in,
    first out, and this hook is registered before spawn registers the teardown): is the group
    destroyed, and is any comm-stream thread still alive?
"""

import atexit
import json
import os
import sys

import torch
import torch.distributed as dist

import minifsdp
from minifsdp.comm import collectives as C
from minifsdp.comm.stream import live_streams

OUT = sys.argv[1]
RANK = os.environ["RANK"]
report = {}


def seq() -> int:
    return dist.group.WORLD._get_backend(torch.device("cpu"))._get_sequence_number_for_group()


def ring_work(offset):
    t = torch.full((1000,), float(dist.get_rank()))
    C.ring_all_reduce(t)  # our comm stream: its thread starts here
    pending = C.ring_all_reduce(torch.ones(10), async_op=True)
    pending.wait()
    g = torch.ones(3)
    dist.all_reduce(g)  # a gloo collective on a tensor made in Python, as the job's last one
    report["seq_after_fn"] = seq()
    return t[0].item() + g[0].item() + offset


def at_exit():
    report["at_exit"] = {"initialized": dist.is_initialized(), "streams": live_streams()}
    with open(os.path.join(OUT, f"rank{RANK}.json"), "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    atexit.register(at_exit)  # registered first, so it runs after minifsdp's teardown
    results = minifsdp.spawn(ring_work, args=(100.0,), world_size=2)
    report["seq_after_spawn"] = seq()
    report["results"] = results
    report["streams_after_spawn"] = live_streams()
    report["world_size_after_spawn"] = dist.get_world_size()  # the group is still usable after spawn
