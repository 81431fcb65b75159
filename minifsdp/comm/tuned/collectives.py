"""The tuned ring's collectives: the textbook's arguments and bits, on gloo as fast as we could make them.

Same signatures as :mod:`minifsdp.comm.ring` plus ``async_op``, like torch's: with
``async_op=True`` they return a :class:`~minifsdp.comm.stream.Work` and run on the group's comm
stream, in issue order, while the caller keeps computing (do not touch the tensor before
``wait()``).  What each does beyond the textbook:

* every collective starts with the header check in fewer messages, its receive posted one
  collective early (:mod:`.header`);
* all-reduce, 2 ranks: a tensor up to the carry room rides inside the header message; a bigger
  one is swapped whole and added (:mod:`.swap`);
* all-reduce, N > 2: pipelined pieces, every receive posted before the first send, the
  all-gather started piece by piece as the reduce-scatter finishes (:mod:`.pipeline`);
* reduce-scatter: the partial sums alternate between ``output`` and one scratch chunk
  (:mod:`.seat`, Note (workspace)).

When one returns (or its ``wait()`` does), nothing of it is kept but the next header receive
(:mod:`minifsdp.comm.stream`, Note (a finished job is dropped)).

Every one of these keeps the textbook's order of additions, so the results are bitwise the
textbook's (``tests/test_collectives.py``, check "tuned_vs_textbook"; ``tests/comm/`` in one process).
"""

from __future__ import annotations

import torch

from minifsdp.comm.checks import check_ready, check_sizes
from minifsdp.comm.ring import chunk_bounds
from minifsdp.comm.stream import CommStream, Work, run_on_stream
from minifsdp.comm.tuned.header import agree_on_header, carry_room
from minifsdp.comm.tuned.pipeline import all_gather_in_place, all_reduce_in_place, reduce_scatter_into
from minifsdp.comm.tuned.seat import Seat
from minifsdp.comm.tuned.swap import swap_all_reduce

__all__ = ["ring_all_reduce", "ring_reduce_scatter", "ring_all_gather"]


def _seat(group, stream: CommStream) -> Seat:
    """This rank's seat for one collective: scratch of its own, the header receives the group's stream keeps."""
    return Seat(group, None, stream.doorbells)


def ring_all_reduce(tensor: torch.Tensor, op="sum", group=None, async_op: bool = False) -> Work | None:
    """In place: every rank's ``tensor`` becomes the sum (or mean) over ranks.  Any shape, any size."""
    group, op = check_ready("ring_all_reduce", group, {"tensor": tensor}, op)

    def job(stream: CommStream) -> None:
        seat, flat = _seat(group, stream), tensor.view(-1)
        carried = seat.size == 2 and flat.numel() * flat.element_size() <= carry_room(seat)
        received = agree_on_header(seat, "all_reduce", tensor, op, carry=flat if carried else None)
        if seat.size == 2 and not carried:
            swap_all_reduce(seat, flat, op)
        else:
            all_reduce_in_place(seat, flat, op, received=received)

    return run_on_stream(group, job, "ring_all_reduce", async_op)


def ring_reduce_scatter(output: torch.Tensor, input: torch.Tensor, op="sum", group=None,
                        async_op: bool = False) -> Work | None:
    """Like ``dist.reduce_scatter_tensor``: ``input`` holds N x output.numel() elements;
    rank r's ``output`` becomes the sum over ranks of chunk r of ``input``.  ``input`` is not modified.
    """
    group, op = check_ready("ring_reduce_scatter", group, {"output": output, "input": input}, op)
    check_sizes("ring_reduce_scatter", input, output, group)

    def job(stream: CommStream) -> None:
        seat = _seat(group, stream)
        agree_on_header(seat, "reduce_scatter", input, op)
        reduce_scatter_into(seat, output, input, op)

    return run_on_stream(group, job, "ring_reduce_scatter", async_op)


def ring_all_gather(output: torch.Tensor, input: torch.Tensor, group=None, async_op: bool = False) -> Work | None:
    """Like ``dist.all_gather_into_tensor``: ``output`` (N x input.numel() elements) becomes
    every rank's ``input`` concatenated in rank order.
    """
    group, _ = check_ready("ring_all_gather", group, {"output": output, "input": input})
    n = check_sizes("ring_all_gather", output, input, group)

    def job(stream: CommStream) -> None:
        seat = _seat(group, stream)
        flat, m = output.view(-1), input.numel()
        agree_on_header(seat, "all_gather", input, "sum")
        flat[seat.rank * m : (seat.rank + 1) * m].copy_(input.view(-1))
        all_gather_in_place(seat, flat, chunk_bounds(flat.numel(), n))

    return run_on_stream(group, job, "ring_all_gather", async_op)
