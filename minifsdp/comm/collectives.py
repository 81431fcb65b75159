"""Chapter 2.2: which collectives FSDP and DDP run -- ``get_collectives(kind)``, one interface.

"All-reduce" is one line in ``torch.distributed``: "every rank holds a tensor; make every rank
hold the sum".  This package builds it by hand, from nothing but ``dist.isend`` / ``dist.irecv``,
twice: as the book draws it, and tuned for gloo.  Any of three can carry FSDP's and DDP's
gradients and parameters::

    kind        what runs                                               where
    "ring"      our ring, tuned for gloo (the default); bitwise the     minifsdp/comm/tuned/
                textbook's results
    "textbook"  our ring as the book draws it, nothing more             minifsdp/comm/ring.py
    "torch"     torch.distributed's own (gloo, NCCL): the oracle        torch.distributed

Each object has ``all_reduce(t, op="sum", group=None, async_op=False)``, ``reduce_scatter(out,
inp, op, group, async_op)`` and ``all_gather(out, inp, group, async_op)``; with ``async_op=True``
they return a work object with ``wait()``.  Ours run on the group's comm stream
(:mod:`minifsdp.comm.stream`), in the order they were issued, so asynchronous calls overlap the
caller's compute and a synchronous one queues behind them.

The names ``ring_all_reduce``, ``ring_reduce_scatter`` and ``ring_all_gather`` here are the tuned
ones (with ``async_op``); the textbook's, without it, are ``minifsdp.comm.ring``'s.
``naive_all_reduce`` is the parameter-server shape, for contrast (:mod:`minifsdp.comm.naive`).

Note (torch's collectives let go before ``wait()`` returns): gloo runs a collective on a worker
thread of its own, which marks the work done (``wait()`` returns) and only then drops its
reference to the work, and with it to the tensors.  Until that thread gets the CPU again, a
tensor the caller has dropped (a gradient after ``zero_grad``) stays alive: a census taken then
counts it, and a test comparing memory with torch fails by chance, by one unit's gradient.  So
on CPU tensors ``TorchCollectives`` hands torch an alias of each tensor that no one else holds
(``detach()``: the same storage, a handle of its own) and, once the work is done, waits until the
alias is held as it was before torch saw it, and only then returns from ``wait()``: both its use count
and its Python object's reference count (while C++ holds a tensor, torch holds one reference on its Python
object, and the thread that drops the last C++ one needs the GIL to let that go too).  The collective keeps
nothing of the caller's, as ours keep nothing (:mod:`minifsdp.comm.stream`, Note (a finished job is
dropped)).  It is usually back within one hand-over of the GIL; the wait gives up after ``LET_GO_S``.
(NCCL's work belongs to a GPU stream, not a thread; GPU tensors go to torch as they are.)

Note (precision): sums are accumulated in the tensor's own dtype, chunk by chunk in ring order
(:mod:`minifsdp.comm.ring`, Note (the same bits on every rank)); ``op="avg"`` divides once; for
integer tensors it raises (floor or round?  say what you mean: sum, then divide yourself).
"""

from __future__ import annotations

import contextlib
import sys
import time

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_flatten, tree_unflatten

from minifsdp.comm import naive, ring
from minifsdp.comm.checks import OPS, check_ready
from minifsdp.comm.counting import ByteStats, count_bytes
from minifsdp.comm.ring import chunk_bounds
from minifsdp.comm.stream import Work, run_on_stream
from minifsdp.comm.tuned.collectives import ring_all_gather, ring_all_reduce, ring_reduce_scatter
from minifsdp.comm.tuned.header import CARRY_BYTES

__all__ = [
    "naive_all_reduce", "ring_all_reduce", "ring_reduce_scatter", "ring_all_gather",
    "chunk_bounds", "count_bytes", "ByteStats", "get_collectives", "COLLECTIVE_KINDS", "Work", "CARRY_BYTES",
    "RingCollectives", "TextbookCollectives", "TorchCollectives", "LettingGoWork", "letting_go", "LET_GO_S",
    "torch_lets_go", "TORCH_FSDP_COLLECTIVES",
]


def naive_all_reduce(tensor: torch.Tensor, op="sum", group=None, root: int = 0) -> None:
    """In place, parameter-server shape (:mod:`minifsdp.comm.naive`), in issue order on the group's comm stream."""
    group, _ = check_ready("naive_all_reduce", group, {"tensor": tensor}, op)
    run_on_stream(group, lambda _: naive.naive_all_reduce(tensor, op, group, root), "naive_all_reduce", False)


class RingCollectives:
    """Our ring, tuned for gloo (:mod:`minifsdp.comm.tuned`), behind the common interface."""

    kind = "ring"

    def all_reduce(self, tensor, op="sum", group=None, async_op=False):
        return ring_all_reduce(tensor, op=op, group=group, async_op=async_op)

    def reduce_scatter(self, output, input, op="sum", group=None, async_op=False):
        return ring_reduce_scatter(output, input, op=op, group=group, async_op=async_op)

    def all_gather(self, output, input, group=None, async_op=False):
        return ring_all_gather(output, input, group=group, async_op=async_op)


class TextbookCollectives:
    """The textbook ring (:mod:`minifsdp.comm.ring`) behind the common interface, on the comm stream
    (which gives it ``async_op`` and issue order; the ring itself is synchronous)."""

    kind = "textbook"

    def all_reduce(self, tensor, op="sum", group=None, async_op=False):
        group, _ = check_ready("ring_all_reduce", group, {"tensor": tensor}, op)
        return run_on_stream(group, lambda _: ring.ring_all_reduce(tensor, op, group), "textbook all_reduce",
                             async_op)

    def reduce_scatter(self, output, input, op="sum", group=None, async_op=False):
        group, _ = check_ready("ring_reduce_scatter", group, {"output": output, "input": input}, op)
        return run_on_stream(group, lambda _: ring.ring_reduce_scatter(output, input, op, group),
                             "textbook reduce_scatter", async_op)

    def all_gather(self, output, input, group=None, async_op=False):
        group, _ = check_ready("ring_all_gather", group, {"output": output, "input": input})
        return run_on_stream(group, lambda _: ring.ring_all_gather(output, input, group),
                             "textbook all_gather", async_op)


LET_GO_S = 2.0  # the longest wait for torch's worker thread to drop a finished collective's tensors


class LettingGoWork:
    """torch's work on CPU tensors; ``wait()`` returns once the process group has let go of them too
    (Note (torch's collectives let go before ``wait()`` returns))."""

    def __init__(self, work, aliases: tuple, own: list):
        self._work, self._aliases, self._own = work, aliases, own  # own: each alias's holders before torch saw it

    def wait(self, *timeout) -> bool:
        if self._work is not None:
            self._work.wait(*timeout)
            self._work = None  # our reference to torch's work (its future holds the outputs)
            deadline = time.monotonic() + LET_GO_S
            while _holders(self._aliases) != self._own and time.monotonic() < deadline:
                time.sleep(1e-4)  # the GIL and the CPU for the thread letting go
            self._aliases = self._own = ()
        return True

    def is_completed(self) -> bool:
        return self._work is None or self._work.is_completed()


def _holders(aliases: tuple) -> list:
    """Who holds each alias: its C++ tensor's use count (torch's ``Tensor._use_count``; 0 where torch lacks
    it) and its Python object's reference count.  Taken the same way before and after, so the two compare."""
    return [(a._use_count() if hasattr(a, "_use_count") else 0, sys.getrefcount(a)) for a in aliases]


def letting_go(call, tensors: tuple, async_op: bool):
    """``call(*tensors, async_op)``; on plain CPU tensors, through aliases whose release ``wait()`` waits for."""
    if not all(type(t) in (torch.Tensor, torch.nn.Parameter) and t.device.type == "cpu" for t in tensors):
        return call(*tensors, async_op)
    aliases = tuple(t.detach() for t in tensors)
    own = _holders(aliases)
    work = LettingGoWork(call(*aliases, True), aliases, own)
    if async_op:
        return work
    work.wait()
    return None


# what torch 2.13's FSDP1 and FSDP2 call: all_reduce (NO_SHARD, HSDP, clipping), reduce_scatter_single (both),
# all_gather_single (FSDP2; FSDP1 on a GPU), all_gather into a list of chunks (FSDP1 on the CPU)
TORCH_FSDP_COLLECTIVES = ("all_reduce", "reduce_scatter_single", "all_gather_single", "all_gather")


@contextlib.contextmanager
def torch_lets_go(names: tuple = TORCH_FSDP_COLLECTIVES):
    """Inside: torch's own ``dist.<name>`` collectives (those torch's FSDP1 and ``fully_shard`` call) go through
    :func:`letting_go`, so their ``wait()`` returns once gloo has let go of the tensors.  For an instrument that
    counts live bytes on torch's side (the census): without it, gloo's worker thread may still hold a finished
    collective's tensors when the count runs, and torch reads high by chance (Note (torch's collectives let go
    before ``wait()`` returns)).  Every tensor of the call goes through, however it is passed: positional
    (FSDP1's ``reduce_scatter_single(out, in)``), by keyword (FSDP2's ``reduce_scatter_single(output=...,
    input=...)``), in a list (FSDP1's ``all_gather(chunks, shard)`` on the CPU).  Changes no number and no
    order; names this torch lacks are left alone."""
    saved = {name: getattr(dist, name) for name in names if hasattr(dist, name)}

    def through(fn):
        def call(*args, async_op=False, **kwargs):  # each tensor goes through an alias, the rest as given
            leaves, spec = tree_flatten((args, kwargs))
            at = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]

            def issue(*aliases):  # (holds the aliases only while it runs: the wait counts who holds them)
                given = list(leaves)
                for i, alias in zip(at, aliases[:-1], strict=True):
                    given[i] = alias
                a, kw = tree_unflatten(given, spec)
                return fn(*a, async_op=aliases[-1], **kw)
            return letting_go(issue, tuple(leaves[i] for i in at), async_op)
        return call

    for name, fn in saved.items():
        setattr(dist, name, through(fn))
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


class TorchCollectives:
    """torch.distributed's own collectives behind the same interface (the oracle); on CPU tensors its
    ``wait()`` returns once torch has let go of them (Note (torch's collectives let go ...))."""

    kind = "torch"

    @staticmethod
    def _op(op):
        if isinstance(op, str):
            if op.lower() not in OPS:
                raise ValueError(f"op={op!r} is not supported here; use 'sum' or 'avg'.")
            return {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG}[op.lower()]
        return op

    def all_reduce(self, tensor, op="sum", group=None, async_op=False):
        op = self._op(op)
        return letting_go(lambda t, a: dist.all_reduce(t, op=op, group=group, async_op=a), (tensor,), async_op)

    def reduce_scatter(self, output, input, op="sum", group=None, async_op=False):
        fn, op = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor, self._op(op)
        return letting_go(lambda o, i, a: fn(o, i, op=op, group=group, async_op=a), (output, input), async_op)

    def all_gather(self, output, input, group=None, async_op=False):
        fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        return letting_go(lambda o, i, a: fn(o, i, group=group, async_op=a), (output, input), async_op)


_KINDS = {"ring": RingCollectives, "textbook": TextbookCollectives, "torch": TorchCollectives}
COLLECTIVE_KINDS = tuple(_KINDS)  # ("ring", "textbook", "torch")


def get_collectives(kind: str = "ring"):
    """The collectives of ``kind`` (one of ``COLLECTIVE_KINDS``): same methods, same arguments."""
    if kind not in _KINDS:
        raise ValueError(f"get_collectives: kind={kind!r} is unknown; use one of {COLLECTIVE_KINDS}: 'ring' "
                         "(ours, tuned for gloo), 'textbook' (ours, minifsdp/comm/ring.py) or 'torch' "
                         "(torch.distributed's).")
    return _KINDS[kind]()
