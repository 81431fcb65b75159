"""Rank function for tests/gpu/test_streams_cuda.py: our FSDP when its step runs on a side stream and the GPU lags.

Our FSDP issues every collective with ``async_op=True`` from the caller's thread, on no stream of its own.
NCCL runs it on its internal stream, which first waits for the work already queued on the *current*
stream; ``work.wait()`` makes the current stream wait for the collective.  So ours is correct on CUDA
if (a) every collective is issued while the stream that produced its input is current, and (b) a buffer
a collective reads or writes is freed (``resize_(0)``, or dropped) only after its ``wait()``.

To make a violation visible on one GPU, the worker queues ``torch.cuda._sleep`` (a kernel that spins
for a number of clock cycles) where a producer would otherwise be done long before its consumer:

    before each unit's forward (its all-gather is issued behind the delay; the prefetched one too),
    on each Block's output gradient (that Block's gradients, and so its reduce-scatter's input, come late),
    before each optimizer step (the next forward's all-gather reads the updated shard only if it waits).

Everything runs under ``torch.cuda.stream(side)``, a stream that is not the default one.  A collective
issued from another stream, or a buffer freed before its collective finished, would read or overwrite
numbers that are not there yet; the losses and parameters would then differ from the same run on the
default stream without delays.  The run uses HYBRID_SHARD over ``(WORLD, WORLD)``: at one rank it is
the sharded strategy that still all-gathers and reduce-scatters (FULL_SHARD becomes NO_SHARD, as in
torch), and NCCL's one-rank all-gather and reduce-scatter are real copies on its stream.

Two guards show the check can fail.  ``unordered_read_is_stale``: with the same delay, a collective
issued from a stream that did not queue the producer reads the old numbers (the delay is long enough
to expose a missing wait).  ``fault=True`` plants that mistake in our FSDP: every all-gather is issued
while another stream is current, one that never waits for the step's work; the delayed run then trains
on parameters the optimizer has not yet updated, and its numbers differ.
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.distributed as dist

from minifsdp.comm.collectives import TorchCollectives
from minifsdp.fsdp import FSDP, ShardingStrategy, transformer_auto_wrap_policy
from minifsdp.models import Block, TinyGPT
from tests._workers_fsdp import to_numpy
from tests.gpu._workers_gpu import _batch, _device

SLEEP_CYCLES = 50_000_000  # about 25 ms at 2 GHz: thousands of times longer than issuing a collective
STEPS = 3


def _delay() -> None:
    torch.cuda._sleep(SLEEP_CYCLES)


def unordered_read_is_stale(device) -> dict:
    """An all-gather issued from the default stream while ``side`` (delayed) writes its input: the old numbers.
    The same all-gather issued from ``side``: the new ones."""
    x = torch.zeros(1 << 20, device=device)
    out = torch.empty_like(x)
    dist.all_gather_into_tensor(out, x)  # the communicator exists before anything is timed
    torch.cuda.synchronize()
    side = torch.cuda.Stream(device)
    with torch.cuda.stream(side):
        _delay()
        x.fill_(1.0)
    dist.all_gather_into_tensor(out, x)  # current stream: the default one, which never saw the fill
    torch.cuda.synchronize()
    stale = bool(out.eq(0).all().item())
    with torch.cuda.stream(side):
        _delay()
        x.fill_(2.0)
        dist.all_gather_into_tensor(out, x)  # issued behind the fill
    torch.cuda.synchronize()
    return {"unordered_read_old_numbers": stale, "ordered_read_new_numbers": bool(out.eq(2).all().item())}


@contextlib.contextmanager
def _counted(counts: dict):
    """Count the all-gathers and reduce-scatters our FSDP issues (its ``collectives="torch"`` path)."""
    saved = {name: getattr(TorchCollectives, name) for name in ("all_gather", "reduce_scatter")}

    def counting(name, fn):
        def call(self, *args, **kwargs):
            counts[name] = counts.get(name, 0) + 1
            return fn(self, *args, **kwargs)
        return call

    for name, fn in saved.items():
        setattr(TorchCollectives, name, counting(name, fn))
    try:
        yield counts
    finally:
        for name, fn in saved.items():
            setattr(TorchCollectives, name, fn)


@contextlib.contextmanager
def _all_gather_off_stream(device):
    """Planted fault: each all-gather is issued with a stream current that never waits for the step's work."""
    other = torch.cuda.Stream(device)
    saved = TorchCollectives.all_gather

    def unordered(self, *args, **kwargs):
        with torch.cuda.stream(other):
            return saved(self, *args, **kwargs)

    TorchCollectives.all_gather = unordered
    try:
        yield
    finally:
        TorchCollectives.all_gather = saved


def _late_gradient(module, inputs, output):
    """Forward hook on a Block: its output's gradient arrives behind a delay (on the stream backward runs on)."""
    if output.requires_grad:
        output.register_hook(lambda grad: _delay())


def _train(device, strategy: str, delayed: bool, fault: bool = False) -> dict:
    world = dist.group.WORLD
    model = FSDP(TinyGPT(seed=0).to(device), sharding_strategy=ShardingStrategy[strategy],
                 process_group=(world, world) if strategy == "HYBRID_SHARD" else None,
                 auto_wrap_policy=functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block}),
                 forward_prefetch=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    if delayed:
        for module in model.modules():
            if isinstance(module, FSDP):
                module.register_forward_pre_hook(lambda m, args: _delay())
            elif isinstance(module, Block):
                module.register_forward_hook(_late_gradient)
    batches = [_batch(step, device) for step in range(STEPS)]
    torch.cuda.synchronize()
    side = torch.cuda.Stream(device) if delayed else torch.cuda.current_stream(device)
    losses, counts = [], {}
    planted = _all_gather_off_stream(device) if fault else contextlib.nullcontext()
    with planted, _counted(counts), torch.cuda.stream(side):
        for x, y in batches:
            loss = model(x, y)
            loss.backward()
            if delayed:
                _delay()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
    torch.cuda.synchronize()
    return {"losses": torch.stack(losses), "params": [p.detach().clone() for p in model.parameters()],
            "counts": counts, "stream_was_default": side == torch.cuda.default_stream(device)}


def streams_worker() -> dict:
    device = _device()
    out = {"guard": unordered_read_is_stale(device)}
    out["no_shard"] = _train(device, "NO_SHARD", delayed=False)
    out["plain"] = _train(device, "HYBRID_SHARD", delayed=False)
    out["delayed"] = _train(device, "HYBRID_SHARD", delayed=True)
    out["planted"] = _train(device, "HYBRID_SHARD", delayed=True, fault=True)
    return to_numpy(out)
