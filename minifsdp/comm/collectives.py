"""Chapter 2.2: collectives written by hand on point-to-point sends and receives.

Every data-parallel trainer needs one operation: "every rank holds a tensor;
make every rank hold the sum".  This module builds it twice, from nothing but
``dist.isend`` / ``dist.irecv``:

* :func:`naive_all_reduce` -- the parameter-server shape: everyone sends to a
  root, the root adds and sends the sum back.  The root moves (N-1) x S bytes
  each way, so it is the bottleneck as N grows.
* :func:`ring_all_reduce` -- a :func:`ring_reduce_scatter` followed by a
  :func:`ring_all_gather`.  Every rank sends 2(N-1)/N x S bytes, almost the
  same for 2 ranks or 2000 (the bandwidth-optimal algorithm; its *latency*,
  2(N-1) steps, does grow with N).  At 2 ranks the same bytes move in one
  trip instead: a small tensor inside the header message (comm/header.py),
  a bigger one swapped whole (comm/swap.py).

How the ring steps go (ASCII picture), the chunking rule for sizes that N does
not divide (S elements -> N chunks, the first S % N one element longer), and why
every rank sends and receives at once: see :mod:`minifsdp.comm.ring`, where the
loops live.  Uneven sizes: rank r never sends chunk r in the reduce-scatter nor
chunk r+1 in the all-gather, so it sends 2S - |c_r| - |c_r+1| elements, between
2(N-1) x floor(S/N) and 2(N-1) x ceil(S/N); exactly 2(N-1)/N x S when N divides S.

Before moving data the ranks check they all called the same collective on
same-sized tensors (if not, every rank raises; nothing hangs).

Note (precision): sums are accumulated in the tensor's own dtype, chunk by
chunk in ring order.  gloo adds in another order, so for fp16/bf16 (and fp32
on random data) at N > 2 results can differ from ``dist.all_reduce`` in the
last bits; integers and exactly representable values match bitwise.
``op="avg"`` is the sum divided by N once, on the owner's chunk; for int64 it
raises (floor or round?  say what you mean: sum, then divide yourself).

Async, like torch: ``async_op=True`` returns a :class:`Work` with ``wait()`` and
``is_completed()``; the ring then runs on the process group's one background
thread (:mod:`minifsdp.comm.stream`), collectives in the order they were
issued, while the caller keeps computing.  Do not touch the tensor before
``wait()``.  Synchronous calls queue on the same thread and wait.

Ours or torch's: :func:`get_collectives` gives other modules one interface,
``get_collectives("ring")`` (these functions) or ``get_collectives("torch")``
(``dist.all_reduce`` and friends), each with ``all_reduce(t, op, group,
async_op)``, ``reduce_scatter(out, inp, op, group, async_op)``,
``all_gather(out, inp, group, async_op)``.

Bytes: ``with count_bytes() as stats: ...`` then ``stats.sent`` and
``stats.received`` are the bytes this rank moved through our collectives
issued inside the block (read them after ``wait()`` for async ones).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from minifsdp.comm.header import CARRY_BYTES, agree_on_header, carry_room
from minifsdp.comm.ring import (
    DTYPES,
    OPS,
    ByteStats,
    Ring,
    active_stats,
    all_gather_in_place,
    all_reduce_in_place,
    chunk_bounds,
    count_bytes,
    reduce_scatter_chunks,
)
from minifsdp.comm.stream import Work, stream_for
from minifsdp.comm.swap import swap_all_reduce

__all__ = [
    "naive_all_reduce", "ring_all_reduce", "ring_reduce_scatter", "ring_all_gather",
    "chunk_bounds", "count_bytes", "ByteStats", "get_collectives", "Work", "CARRY_BYTES",
]


# ----------------------------------------------------------------------------- checks
def _check_ready(name: str, group, tensors: dict[str, torch.Tensor], op=None) -> tuple[object, str]:
    """Clear errors for the usual mistakes; returns (group, op name)."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            f"{name} was called before the process group exists: call "
            "torch.distributed.init_process_group(...) first, "
            "or run your function with minifsdp.spawn(fn, world_size=N)."
        )
    group = group if group is not None else dist.group.WORLD
    if dist.get_rank(group) < 0:
        raise ValueError(f"{name}: this rank ({dist.get_rank()}) is not a member of the given group; "
                         "call collectives only on ranks that belong to the group.")
    for label, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: {label} must be a torch.Tensor, got {type(t).__name__}.")
        if not t.is_contiguous():
            raise ValueError(f"{name}: {label} is not contiguous (shape {tuple(t.shape)}, stride {t.stride()}); "
                             "pass t.contiguous() and copy the result back if you need it in t.")
        if t.dtype not in DTYPES:
            raise TypeError(f"{name}: dtype {t.dtype} is not supported; use one of {[str(d) for d in DTYPES]}.")
    dtypes = {t.dtype for t in tensors.values()}
    if len(dtypes) > 1:
        raise TypeError(f"{name}: output and input must have the same dtype, got {sorted(map(str, dtypes))}.")
    if op is None:
        return group, "sum"
    key = op.lower() if isinstance(op, str) else _reduce_op_name(op)
    if key not in OPS:
        raise ValueError(f"{name}: op={op!r} is not supported by our ring collectives; use 'sum' or 'avg' "
                         "(or dist.ReduceOp.SUM / AVG); for MAX/MIN/PRODUCT use torch.distributed.all_reduce.")
    if key == "avg" and not next(iter(dtypes)).is_floating_point:
        raise TypeError(f"{name}: op='avg' on integer tensors is ambiguous (floor? round?); "
                        "use op='sum' and divide the result yourself.")
    return group, key


def _reduce_op_name(op) -> str | None:
    """'sum' / 'avg' for dist.ReduceOp.SUM / AVG, else None."""
    for name, torch_op in (("sum", dist.ReduceOp.SUM), ("avg", dist.ReduceOp.AVG)):
        try:
            if op == torch_op:
                return name
        except TypeError:
            return None
    return None


def _run(name: str, group, job, async_op: bool) -> Work | None:
    """Run ``job(ring)`` on the group's comm stream; wait unless ``async_op``.

    A synchronous call on an idle stream runs in the calling thread instead (the same order,
    two thread wake-ups fewer: :meth:`CommStream.run_inline_if_idle`).  The header receives
    posted ahead (header.py, Note (doorbell)) live with the stream: one set per group.
    """
    stats = active_stats()  # bytes belong to the block that *issued* the collective
    stream = stream_for(group)
    bells = stream.__dict__.setdefault("doorbells", {})

    def ring_job() -> None:
        job(Ring(group, stats, stream.workspace, bells))

    if not async_op and stream.run_inline_if_idle(ring_job):
        return None
    work = stream.submit(ring_job, name)
    if async_op:
        return work
    work.wait()
    return None


# ----------------------------------------------------------------------------- public collectives
def ring_all_reduce(tensor: torch.Tensor, op="sum", group=None, async_op: bool = False) -> Work | None:
    """In place: every rank's ``tensor`` becomes the sum (or mean) over ranks.  Any shape, any size.

    A ring reduce-scatter then a ring all-gather over the chunks of ``tensor.view(-1)``
    (the picture is in :mod:`minifsdp.comm.ring`).  Returns a :class:`Work` if ``async_op`` else None.
    """
    group, op = _check_ready("ring_all_reduce", group, {"tensor": tensor}, op)

    def job(ring: Ring) -> None:
        flat = tensor.view(-1)
        carried = ring.size == 2 and flat.numel() * flat.element_size() <= carry_room(ring)
        received = agree_on_header(ring, "all_reduce", tensor, op, carry=flat if carried else None)
        if ring.size == 2 and not carried:
            swap_all_reduce(ring, flat, op)  # comm/swap.py
        else:
            all_reduce_in_place(ring, flat, op, received=received)

    return _run("ring_all_reduce", group, job, async_op)


def ring_reduce_scatter(output: torch.Tensor, input: torch.Tensor, op="sum", group=None,
                        async_op: bool = False) -> Work | None:
    """Like ``dist.reduce_scatter_tensor``: ``input`` holds N x output.numel() elements;
    rank r's ``output`` becomes the sum over ranks of chunk r of ``input``.  ``input`` is not modified.
    """
    group, op = _check_ready("ring_reduce_scatter", group, {"output": output, "input": input}, op)
    n = dist.get_world_size(group)
    if input.numel() != n * output.numel():
        raise ValueError(f"ring_reduce_scatter: input has {input.numel()} elements but must have "
                         f"world_size x output.numel() = {n} x {output.numel()} = {n * output.numel()}.")

    def job(ring: Ring) -> None:
        r, m = ring.rank, output.numel()
        chunks = input.view(n, m)
        agree_on_header(ring, "reduce_scatter", input, op)
        if n == 1:
            output.view(-1).copy_(chunks[0])
            return
        # Partial sums in flight alternate between two buffers (we send one while receiving into
        # the other): ``output`` itself and one scratch chunk, chosen so that the last step
        # receives straight into ``output`` and adds our own chunk there.  So 2 ranks need no
        # scratch and any more ranks one chunk of it: FSDP's peak holds no full-size copy of a
        # unit's gradient for the ring.  (Unless ``output`` is a piece of ``input``: then
        # receiving into it would overwrite a chunk not yet added, so two scratch chunks.)
        #     N=4: step 0 -> output, step 1 -> scratch, step 2 -> output (+ our chunk: done)
        aliased = output.untyped_storage().data_ptr() == input.untyped_storage().data_ptr()
        out = output.view(-1)
        if aliased:
            scratch = ring.scratch(2 * m, input)
            into = [scratch[(s % 2) * m:(s % 2 + 1) * m] for s in range(n - 1)]
        else:
            scratch = ring.scratch(m, input) if n > 2 else None
            into = [out if (n - 2 - s) % 2 == 0 else scratch for s in range(n - 1)]
        sending = chunks[reduce_scatter_chunks(r, n, 0)[0]]
        for s, received in enumerate(into):
            recv_c = reduce_scatter_chunks(r, n, s)[1]
            ring.step(sending, received)
            if recv_c == r:  # the last step: our chunk, once added, is summed over all ranks
                torch.add(received, chunks[r], out=out)  # a + b and b + a: the same bits
            else:
                sending = received.add_(chunks[recv_c])
        if op == "avg":
            output.div_(n)

    return _run("ring_reduce_scatter", group, job, async_op)


def ring_all_gather(output: torch.Tensor, input: torch.Tensor, group=None, async_op: bool = False) -> Work | None:
    """Like ``dist.all_gather_into_tensor``: ``output`` (N x input.numel() elements) becomes
    every rank's ``input`` concatenated in rank order.
    """
    group, _ = _check_ready("ring_all_gather", group, {"output": output, "input": input})
    n = dist.get_world_size(group)
    if output.numel() != n * input.numel():
        raise ValueError(f"ring_all_gather: output has {output.numel()} elements but must have "
                         f"world_size x input.numel() = {n} x {input.numel()} = {n * input.numel()}.")

    def job(ring: Ring) -> None:
        flat, m = output.view(-1), input.numel()
        agree_on_header(ring, "all_gather", input, "sum")
        flat[ring.rank * m : (ring.rank + 1) * m].copy_(input.view(-1))
        all_gather_in_place(ring, flat, chunk_bounds(flat.numel(), n))

    return _run("ring_all_gather", group, job, async_op)


def naive_all_reduce(tensor: torch.Tensor, op="sum", group=None, root: int = 0) -> None:
    """In place, parameter-server shape: all ranks send to ``root`` (a group rank), root sums, sends back.

    The root receives and sends (N-1) x S bytes; everyone else sends and receives S.
    """
    group, op = _check_ready("naive_all_reduce", group, {"tensor": tensor}, op)
    n = dist.get_world_size(group)
    if not 0 <= root < n:
        raise ValueError(f"naive_all_reduce: root={root} is not a rank of the group (0..{n - 1}).")

    def job(ring: Ring) -> None:
        agree_on_header(ring, "naive_all_reduce", tensor, op, extra=root)
        flat, empty = tensor.view(-1), tensor.new_empty(0)
        if ring.rank != root:
            ring.exchange(flat, root, empty, root)  # my data up ...
            ring.exchange(empty, root, flat, root)  # ... the sum down
            return
        others = [i for i in range(n) if i != root]
        inbox = [torch.empty_like(flat) for _ in others]
        for i, buf in zip(others, inbox):
            ring.exchange(empty, i, buf, i)
        for buf in inbox:  # add in rank order: deterministic
            flat.add_(buf)
        if op == "avg":
            flat.div_(n)
        for i in others:
            ring.exchange(flat, i, empty, i)

    _run("naive_all_reduce", group, job, async_op=False)


# ----------------------------------------------------------------------------- ours or torch's
class RingCollectives:
    """Our hand-written ring collectives behind the common interface."""

    kind = "ring"

    def all_reduce(self, tensor, op="sum", group=None, async_op=False):
        return ring_all_reduce(tensor, op=op, group=group, async_op=async_op)

    def reduce_scatter(self, output, input, op="sum", group=None, async_op=False):
        return ring_reduce_scatter(output, input, op=op, group=group, async_op=async_op)

    def all_gather(self, output, input, group=None, async_op=False):
        return ring_all_gather(output, input, group=group, async_op=async_op)


class TorchCollectives:
    """torch.distributed's own collectives behind the same interface (the oracle)."""

    kind = "torch"

    @staticmethod
    def _op(op):
        if isinstance(op, str):
            if op.lower() not in OPS:
                raise ValueError(f"op={op!r} is not supported here; use 'sum' or 'avg'.")
            return {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG}[op.lower()]
        return op

    def all_reduce(self, tensor, op="sum", group=None, async_op=False):
        return dist.all_reduce(tensor, op=self._op(op), group=group, async_op=async_op)

    def reduce_scatter(self, output, input, op="sum", group=None, async_op=False):
        fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        return fn(output, input, op=self._op(op), group=group, async_op=async_op)

    def all_gather(self, output, input, group=None, async_op=False):
        fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        return fn(output, input, group=group, async_op=async_op)


def get_collectives(kind: str = "ring"):
    """``"ring"``: our collectives; ``"torch"``: torch.distributed's.  Same methods, same arguments."""
    if kind == "ring":
        return RingCollectives()
    if kind == "torch":
        return TorchCollectives()
    raise ValueError(f"get_collectives: kind={kind!r} is unknown; use 'ring' (ours) or 'torch'.")
