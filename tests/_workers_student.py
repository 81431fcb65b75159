"""Deliberately wrong exercise solutions, plugged into our FSDP by tests/test_student_impl.py.

``--student 2.2=tests._workers_student``: a ring reduce-scatter that forgets its last step
(the all-gather and all-reduce are minifsdp's own, right ones, so only 2.2a is to blame);
``--student 2.5=tests._workers_student``: a prefetch order read the wrong way round;
``--student 2.1a=tests._workers_student``: an unflatten that hands two same-shaped views out in
swapped order (flatten_and_shard is minifsdp's own, right one).
"""

import torch
import torch.distributed as dist

from exercises.solutions.fsdp_tasks import flatten_and_shard  # noqa: F401  (the right one)
from exercises.solutions.fsdp_tasks import unflatten as _right_unflatten
from minifsdp.comm.collectives import ring_all_gather, ring_all_reduce  # noqa: F401  (the right ones)


def ring_reduce_scatter(output: torch.Tensor, input: torch.Tensor, group=None) -> None:
    """Task 2.2a as the text says, but with N - 2 ring steps instead of N - 1."""
    n, r = dist.get_world_size(group), dist.get_rank(group)
    peer = (lambda g: g) if group is None else (lambda g: dist.get_global_rank(group, g))
    chunks = input.view(n, -1)
    sending, received = chunks[(r - 1) % n].clone(), torch.empty_like(chunks[0])
    for s in range(n - 2):  # the bug: the last step (which brings chunk r home) is forgotten
        ops = [dist.isend(sending, peer((r + 1) % n), group=group),
               dist.irecv(received, peer((r - 1) % n), group=group)]
        for op in ops:
            op.wait()
        sending = received + chunks[(r - s - 2) % n]
    output.view(-1).copy_(sending)


def prefetch_target(pre_forward: list, post_forward: list, unit, mode: str):
    """Task 2.5 with the backward read forwards: the unit *after* ``unit`` in post_forward."""
    order = pre_forward if mode == "forward" else post_forward
    if unit not in order:
        return None
    i = order.index(unit) + 1
    return order[i] if i < len(order) else None


def unflatten(flat: torch.Tensor, shapes: list[torch.Size]) -> list[torch.Tensor]:
    """Task 2.1a (ii) with a bug: the first two neighbours of equal shape (a LayerNorm's weight and bias) swapped."""
    views = _right_unflatten(flat, shapes)
    i = next(i for i in range(len(shapes) - 1) if shapes[i] == shapes[i + 1])
    views[i], views[i + 1] = views[i + 1], views[i]
    return views
