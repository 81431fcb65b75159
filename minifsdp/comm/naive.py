"""Chapter 2.2: the all-reduce everyone writes first -- send everything to one rank -- for contrast.

The parameter-server shape: every rank sends its tensor to a ``root``, the root adds them and
sends the sum back::

    rank 1 --S--> root <--S-- rank 2          the root receives (N-1) x S bytes and sends (N-1) x S:
    rank 1 <--S-- root --S--> rank 2          it is the bottleneck as N grows

The ring (:mod:`minifsdp.comm.ring`) sends 2(N-1)/N x S per rank, nearly S whatever N is, and no
rank does more than the others.  DDP does not use a parameter server (the source says it does).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from minifsdp.comm.checks import agree_on_call, check_ready
from minifsdp.comm.counting import active_stats

__all__ = ["naive_all_reduce"]


def _move(group, tensor: torch.Tensor, peer: int, send: bool):
    """Start sending ``tensor`` to (or receiving it from) group rank ``peer``, counting its bytes."""
    nbytes = tensor.numel() * tensor.element_size()
    for stats in active_stats():
        if send:
            stats.add(sent=nbytes, messages=int(nbytes > 0))
        else:
            stats.add(received=nbytes)
    if not nbytes:
        return None
    start = dist.isend if send else dist.irecv
    return start(tensor, dist.get_global_rank(group, peer), group=group)


def naive_all_reduce(tensor: torch.Tensor, op="sum", group=None, root: int = 0) -> None:
    """In place: all ranks send to ``root`` (a group rank), root sums in rank order and sends the sum back."""
    group, op = check_ready("naive_all_reduce", group, {"tensor": tensor}, op)
    n, me = dist.get_world_size(group), dist.get_rank(group)
    if not 0 <= root < n:
        raise ValueError(f"naive_all_reduce: root={root} is not a rank of the group (0..{n - 1}).")
    agree_on_call(group, "naive_all_reduce", tensor, op, extra=root)
    flat = tensor.view(-1)
    if me != root:
        for send in (True, False):  # my data up ... the sum down
            work = _move(group, flat, root, send)
            if work is not None:
                work.wait()
        return
    others = [i for i in range(n) if i != root]
    inbox = [torch.empty_like(flat) for _ in others]
    for work in [_move(group, buf, i, send=False) for i, buf in zip(others, inbox, strict=True)]:
        if work is not None:
            work.wait()
    for buf in inbox:  # add in rank order: deterministic
        flat.add_(buf)
    if op == "avg":
        flat.div_(n)
    for work in [_move(group, flat, i, send=True) for i in others]:
        if work is not None:
            work.wait()
