"""DataParallel by hand: one process, N model replicas, threads -- and why torch moved on.

This is the recipe of ``torch.nn.DataParallel``, done step by step so its
costs are visible.  On every forward, from one Python process:

    primary module (device 0)
        |  1. replicate: broadcast every parameter to N replicas  (every step!)
        |  2. scatter:   split the batch along dim 0 into N chunks
        v
    replica 0   replica 1   ...   replica N-1      3. parallel apply: one thread each
        |           |                 |
        +-----------+-----------------+
                    v
        4. gather: concatenate the outputs on device 0 (the loss is computed there)

    backward: the gradient flows back through the gather to each replica, then
        5. reduce: each replica's parameter gradients are summed into the primary's .grad

Here the "devices" are CPU replicas; with GPUs they would be ``cuda:0..N-1``.
Step 5 needs no code of its own: the broadcast in step 1 is an autograd
function whose backward is the sum (see :class:`_Broadcast`).

Why torch's docs say "use DistributedDataParallel instead":

* One process drives all devices, so the Python work of every replica's
  forward and backward is serialised by the GIL: threads overlap only the parts
  that run outside Python.
* The primary is a hub: parameters are broadcast from it and gradients reduced
  into it, every step, so device 0 does more work and holds more memory than the
  others, and the traffic all goes through it (the parameter-server shape that
  a ring avoids).
* Replicating every step costs a full copy of the model per step.
* It cannot span machines.

DDP instead runs one process per device, keeps one long-lived replica in each,
and only all-reduces gradients (in buckets, overlapped with backward); every
rank is equal, and nothing is replicated after the first broadcast.

Note (equal to one model on the whole batch): the loss on the gathered output
is the loss of the full batch, so the primary's gradient is the full-batch
gradient, up to the order of floating-point sums (each replica sums over its
chunk, then the chunks are summed).
"""

from __future__ import annotations

import copy
import threading

import torch
import torch.nn as nn
from torch.func import functional_call

__all__ = ["DataParallel"]


class _Broadcast(torch.autograd.Function):
    """forward: N copies of each tensor ("send to each device"); backward: sum of the N gradients ("reduce")."""

    @staticmethod
    def forward(ctx, n_copies: int, *tensors):
        ctx.n_copies, ctx.n_tensors = n_copies, len(tensors)
        return tuple(t.clone() for _ in range(n_copies) for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        n = ctx.n_tensors
        summed = []
        for j in range(n):
            parts = [grads[c * n + j] for c in range(ctx.n_copies) if grads[c * n + j] is not None]
            summed.append(torch.stack(parts).sum(0) if parts else None)
        return (None, *summed)


class DataParallel(nn.Module):
    """Single-process data parallelism over ``len(device_ids)`` replicas (CPU copies here).

    Args:
        module: the model; its parameters are the primary copy that the optimizer updates.
        device_ids: one entry per replica (default: two CPU replicas).  On CPU the
            entries only count replicas; all of them live in host memory.

    ``forward(x, *rest)`` splits every tensor argument along dim 0 and returns
    the outputs concatenated along dim 0, so compute the loss on the result.
    """

    def __init__(self, module: nn.Module, device_ids=None):
        super().__init__()
        self.module = module
        self.device_ids = list(device_ids) if device_ids is not None else [0, 1]
        if not self.device_ids:
            raise ValueError("device_ids is empty; pass e.g. device_ids=[0, 1] for two replicas.")
        # The replicas' *structure*; their parameters are re-sent from the primary every forward.
        self._shells = [copy.deepcopy(module) for _ in self.device_ids]

    def forward(self, *inputs):
        n = len(self.device_ids)
        batch = inputs[0].shape[0]
        if batch < n:
            raise ValueError(f"batch of {batch} rows cannot be split over {n} replicas; use a batch of at least {n}.")
        # 1. replicate: every parameter, from the primary to every replica (differentiable).
        names = [name for name, _ in self.module.named_parameters()]
        params = [p for _, p in self.module.named_parameters()]
        copies = _Broadcast.apply(n, *params)
        per_replica = [dict(zip(names, copies[c * len(params) : (c + 1) * len(params)])) for c in range(n)]
        buffers = dict(self.module.named_buffers())
        # 2. scatter: chunk c of every tensor argument goes to replica c.
        chunks = [torch.tensor_split(x, n, dim=0) if torch.is_tensor(x) else [x] * n for x in inputs]
        # 3. parallel apply: one thread per replica.
        outputs: list = [None] * n
        errors: list = [None] * n

        def run(c: int) -> None:
            try:
                args = tuple(chunk[c] for chunk in chunks)
                outputs[c] = functional_call(self._shells[c], {**per_replica[c], **buffers}, args)
            except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
                errors[c] = e

        threads = [threading.Thread(target=run, args=(c,)) for c in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for c, e in enumerate(errors):
            if e is not None:
                raise RuntimeError(f"replica {c} failed in forward: {e}") from e
        # 4. gather: concatenate on the primary (scalars, e.g. per-replica losses, become a vector).
        if outputs[0].dim() == 0:
            return torch.stack(outputs)
        return torch.cat(outputs, dim=0)
