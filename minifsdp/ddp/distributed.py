"""DistributedDataParallel from scratch: one process per rank, gradients averaged in buckets.

Every rank holds a full copy of the model and trains on its own slice of the
global batch.  After backward, each gradient is replaced by the mean over
ranks, so every rank takes the same optimizer step and the copies stay equal:

    rank 0: forward(x0) -> backward -> g0 ─┐
    rank 1: forward(x1) -> backward -> g1 ─┼─ all-reduce(sum) of g/N ─> every rank: (g0+g1+...)/N
    rank N-1: ...                         ─┘

What makes it fast is *when* the all-reduce happens.  A hook on each parameter
fires as soon as backward has accumulated that parameter's gradient; the
gradient is copied (pre-divided by N) into its bucket (see ``buckets.py``), and
when a bucket is full of ready gradients its all-reduce starts *asynchronously*
while backward keeps computing the layers below:

    backward:  [grads of layer 3][grads of layer 2][grads of layer 1][layer 0]
    network:                     [all-reduce bucket 0 ][all-reduce bucket 1]
                                                             ^ end of backward: wait, copy back into p.grad

At the very end of backward (a callback queued on the autograd engine by the
first hook) we wait for the buckets and copy the averaged slices back into
each ``p.grad``.  Then ``optimizer.step()`` sees averaged gradients, as with torch.

Note (bitwise the same as torch's DDP): torch's C++ Reducer, with no comm hook,
computes ``bucket_slice = grad * (1 / world_size)`` while copying each gradient
into its bucket (``at::mul_out`` with the scalar ``1.0 / world_size``), then
all-reduces the bucket with SUM and copies it back.  We do exactly that, so
with the same all-reduce the results match bit for bit.  Dividing *after* the
sum, or averaging with ``ReduceOp.AVG``, gives (slightly) different bits.

Note (same order everywhere): collectives are matched by the order in which
ranks issue them.  Buckets are therefore launched strictly in bucket order (a
bucket that is ready early waits for the buckets before it), as torch does.

Note (control tensors live where the backend can reach them): besides the
gradient buckets, DDP sends two small messages of its own, the shape signature
(``verify_same_shapes``) and rank 0's parameters and buffers.  A plain "nccl"
group moves CUDA tensors only, so a CPU tensor there fails; :func:`collective_device`
picks the device for such control tensors (CPU whenever the group has a CPU
backend: "gloo", "cpu:gloo,cuda:nccl"; else the module's device or the current
GPU), and :func:`check_backend_supports` turns a CPU module on an NCCL-only group
into a clear error at construction instead of a failure inside the first collective.

Note (tied weights): ``lm_head.weight is tok_emb.weight`` appears once in
``named_parameters()``; autograd sums both uses into one ``.grad`` before the
post-accumulate hook fires, so the hook fires once per backward, after the
gradient is complete.
"""

from __future__ import annotations

import contextlib
import time
import weakref
import zlib

import torch
import torch.distributed as dist
import torch.nn as nn

from minifsdp.comm.collectives import COLLECTIVE_KINDS, get_collectives
from minifsdp.comm.devices import backend_devices, check_backend_supports, collective_device
from minifsdp.ddp.buckets import Bucket, assign_buckets, fill_buckets

__all__ = ["DistributedDataParallel", "DDP", "assign_buckets", "verify_same_shapes", "backend_devices",
           "collective_device", "check_backend_supports"]

MiB = 2**20


def _all_reduce_sum(kind: str):
    """Return ``f(tensor, group) -> handle`` starting an async SUM all-reduce of the chosen kind."""
    if kind == "torch":
        return lambda t, group: dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group, async_op=True)
    if kind in COLLECTIVE_KINDS:
        ours = get_collectives(kind)
        return lambda t, group: ours.all_reduce(t, op="sum", group=group, async_op=True)
    raise ValueError(f"collectives must be one of {COLLECTIVE_KINDS}, got {kind!r}")


def verify_same_shapes(module: nn.Module, group=None) -> None:
    """Raise on every rank if the ranks' parameters differ in name, shape or dtype.

    Cheap in the common case: one all-gather of two integers per rank (the
    number of parameters and a CRC of their names, shapes and dtypes).  Only
    when they differ do the ranks exchange the full lists to name the culprit.
    Every rank sees every signature, so every rank raises: none is left waiting.
    """
    sig = [(name, tuple(p.shape), str(p.dtype)) for name, p in module.named_parameters()]
    device = collective_device(group, like=next(module.parameters(), None))
    mine = torch.tensor([len(sig), zlib.crc32(repr(sig).encode())], dtype=torch.int64, device=device)
    world = dist.get_world_size(group)
    everyone = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(everyone, mine, group=group)
    if all(torch.equal(everyone[0], t) for t in everyone):
        return
    sigs: list = [None] * world
    dist.all_gather_object(sigs, sig, group=group)
    for r in range(1, world):
        for i in range(max(len(sigs[0]), len(sigs[r]))):
            a = sigs[0][i] if i < len(sigs[0]) else "(none)"
            b = sigs[r][i] if i < len(sigs[r]) else "(none)"
            if a != b:
                raise ValueError(
                    f"DistributedDataParallel needs the same model on every rank, but parameter #{i} differs: "
                    f"rank 0 has {a}, rank {r} has {b}. Fix: build the model from the same config and code "
                    "on every rank before wrapping it."
                )


class DistributedDataParallel(nn.Module):
    """Data parallelism across processes; a from-scratch ``torch.nn.parallel.DistributedDataParallel``.

    Args:
        module: the model; every rank must build the same one (checked).
        bucket_cap_mb: a bucket is closed once it holds at least this many MiB of
            gradients (25 by default, as torch).  Smaller: more, earlier
            all-reduces (more overlap, more per-message latency); larger: fewer,
            later ones.
        process_group: the ranks to average over (None: all of them).
        collectives: "torch" (``dist.all_reduce``, gloo/NCCL's algorithm), "ring" (our ring
            all-reduce, tuned for gloo: ``minifsdp.comm.tuned``) or "textbook" (our ring as
            chapter 2.2 draws it: ``minifsdp/comm/ring.py``); ``minifsdp.comm.COLLECTIVE_KINDS``.
        broadcast_buffers: broadcast rank 0's buffers before every forward, as torch.
        trace: record ``bucket_events`` (one dict per bucket per backward) for plots.
        bucket_layout: "reverse" (default): buckets filled in reverse registration
            order from the first step.  "torch": torch's exact two phases, one
            bucket in registration order for the first backward, then buckets
            rebuilt once in the order gradients were seen to become ready.  The
            layout decides which ranks' numbers a ring algorithm adds first for
            each element, so only "torch" is bitwise equal to torch's DDP at
            3+ ranks (at 2 ranks, a + b == b + a, and both are).  Measured
            (tests/test_ddp.py, TinyGPT and MLP, 5 steps): "torch" layout with
            collectives="torch" is bitwise at 2, 3 and 4 ranks; the "reverse"
            layout, or our ring at 4 ranks, differ by at most ~1e-7 (SGD) and
            ~1e-5 (AdamW).

    Attributes:
        module: the wrapped model.
        buckets: for teaching, a list of ``{"index", "bytes", "params"}`` dicts:
            which parameter names share each bucket, in launch order.
        bucket_events: with ``trace=True``, the last backward's buckets as
            ``{"bucket", "bytes", "issued", "finished"}`` (``time.perf_counter`` seconds),
            and ``backward_window = (first hook, end of backward)``.  gloo's
            handles call us back when they finish; for handles without a future
            (our ring), ``finished`` is when we first *saw* it done (at a later
            hook or at the final wait), an upper bound.
    """

    def __init__(self, module: nn.Module, bucket_cap_mb: float = 25, process_group=None,
                 collectives: str = "torch", broadcast_buffers: bool = True, trace: bool = False,
                 bucket_layout: str = "reverse"):
        super().__init__()
        if not dist.is_initialized():
            raise RuntimeError("DistributedDataParallel needs a process group: run under minifsdp.spawn or torchrun.")
        self.module = module
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.bucket_cap_mb = bucket_cap_mb
        self.broadcast_buffers = broadcast_buffers
        self.trace = trace
        self._all_reduce = _all_reduce_sum(collectives)
        self.collectives = collectives

        check_backend_supports(process_group, list(module.parameters()) + list(module.buffers()),
                               "DistributedDataParallel")
        verify_same_shapes(module, process_group)
        with torch.no_grad():  # every rank starts from rank 0's numbers
            for t in list(module.parameters()) + list(module.buffers()):
                dist.broadcast(t, group=process_group, group_src=0)

        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]  # tied: listed once
        self._names = [n for n, _ in named]
        self._params = [p for _, p in named]
        if bucket_layout == "reverse":
            self._set_buckets(assign_buckets(self._params, int(bucket_cap_mb * MiB)))
            self._rebuild_pending = False
        elif bucket_layout == "torch":  # one bucket per dtype, registration order, until we know the real order
            self._set_buckets(fill_buckets(self._params, range(len(self._params)), [2**62]))
            self._rebuild_pending = True
        else:
            raise ValueError(f"bucket_layout must be 'reverse' or 'torch', got {bucket_layout!r}")
        self._require_sync = True
        self._in_backward = False
        self._next_to_launch = 0
        self._ready: dict[int, None] = {}  # param indices in the order their gradients arrived
        self.bucket_events: list[dict] = []
        self.backward_window: tuple[float, float] | None = None
        self._hooks = [p.register_post_accumulate_grad_hook(self._make_hook(i)) for i, p in enumerate(self._params)]

    def _set_buckets(self, groups: list[list[int]]) -> None:
        self._buckets = [Bucket(b, idx, self._params) for b, idx in enumerate(groups)]
        self._where = {}  # param index -> (bucket, slot in bucket)
        for bucket in self._buckets:
            for k, i in enumerate(bucket.param_indices):
                self._where[i] = (bucket, k)
        self.buckets = [
            {"index": b.index, "bytes": b.nbytes, "params": [self._names[i] for i in b.param_indices]}
            for b in self._buckets
        ]

    def forward(self, *args, **kwargs):
        if self.broadcast_buffers and self.world_size > 1:
            with torch.no_grad():
                for buf in self.module.buffers():
                    dist.broadcast(buf, group=self.process_group, group_src=0)
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        """Skip the all-reduce: gradients accumulate locally in ``p.grad``.

        Wrap the forward *and* the backward of the micro-batches to accumulate;
        the first backward outside reduces the accumulated sum, as torch.
        """
        old, self._require_sync = self._require_sync, False
        try:
            yield
        finally:
            self._require_sync = old

    # --- backward: hooks, buckets, the final wait -------------------------------------------------

    def _make_hook(self, i: int):
        # The hook lives on the parameter (in C++, out of the garbage collector's sight): holding
        # ``self`` strongly would keep every dropped DDP model alive.  A weak reference does not.
        ddp = weakref.ref(self)

        def hook(p: torch.Tensor) -> None:
            self = ddp()
            if self is None or not self._require_sync:
                return
            if not self._in_backward:  # first gradient of this backward
                self._start_backward()
            bucket, k = self._where[i]
            # The Reducer's averaging: scale by 1/N while copying in, then SUM.
            torch.mul(p.grad, 1.0 / self.world_size, out=bucket.view(k))
            bucket.pending -= 1
            self._ready[i] = None
            self._launch_ready_buckets()
            if self.trace:
                self._poll_finished()

        return hook

    def _start_backward(self) -> None:
        self._in_backward = True
        self._next_to_launch = 0
        self._ready = {}
        for bucket in self._buckets:
            bucket.reset()
        self.bucket_events = []
        self.backward_window = (time.perf_counter(), float("nan"))
        torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)

    def _launch_ready_buckets(self) -> None:
        while self._next_to_launch < len(self._buckets) and self._buckets[self._next_to_launch].pending == 0:
            bucket = self._buckets[self._next_to_launch]
            event = {"bucket": bucket.index, "bytes": bucket.nbytes, "issued": time.perf_counter(), "finished": None}
            bucket.handle = self._all_reduce(bucket.flat, self.process_group)
            if self.trace:
                self.bucket_events.append(event)
                future = getattr(bucket.handle, "get_future", None)
                if future is not None:
                    future().add_done_callback(lambda _f, e=event: e.__setitem__("finished", time.perf_counter()))
            self._next_to_launch += 1

    def _poll_finished(self) -> None:
        """Stamp buckets whose all-reduce has finished (for handles without a future to call us back)."""
        for event in self.bucket_events:
            if event["finished"] is None:
                is_completed = getattr(self._buckets[event["bucket"]].handle, "is_completed", None)
                if is_completed is not None and is_completed():
                    event["finished"] = time.perf_counter()

    def _finish_backward(self) -> None:
        """Runs once, when autograd has finished this backward."""
        self._in_backward = False
        for bucket in self._buckets:
            if bucket.handle is not None:
                bucket.handle.wait()
                if self.trace:
                    self._poll_finished()
        if self._next_to_launch < len(self._buckets):
            missing = [self._names[i] for i in range(len(self._params)) if i not in self._ready]
            raise RuntimeError(
                "DistributedDataParallel: these parameters got no gradient in this backward, so their bucket was "
                f"never sent: {missing[:5]}{' ...' if len(missing) > 5 else ''}. Every parameter with "
                "requires_grad=True must be used in the loss; set requires_grad=False on unused ones "
                "(torch's find_unused_parameters is not implemented here)."
            )
        for bucket in self._buckets:
            bucket.copy_grads_out()
        for event in self.bucket_events:
            if event["finished"] is None:  # a handle without a future: we only know when wait() returned
                event["finished"] = time.perf_counter()
        self.backward_window = (self.backward_window[0], time.perf_counter())
        if self._rebuild_pending:  # bucket_layout="torch": rebuild once, in the order just observed
            self._rebuild_pending = False
            self._set_buckets(fill_buckets(self._params, list(self._ready), [int(self.bucket_cap_mb * MiB)]))


DDP = DistributedDataParallel
