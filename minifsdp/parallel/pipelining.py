"""Chapters 1 and 4.4: a pipeline stage built on point-to-point messages (torch's ``PipelineStage``, from scratch).

Pipeline parallelism cuts a model into consecutive pieces, one per rank.  Rank ``s`` holds *stage* ``s``;
a batch is cut along dim 0 into micro-batches, and each micro-batch flows through the stages: activations go
forward (stage s -> s+1), gradients of those activations come back (stage s+1 -> s).  Nothing else moves:
no parameter or gradient is ever communicated, only the tensors at the cut::

         stage 0 (rank 0)             stage 1 (rank 1)                 stage 2 (rank 2)
    x -> [ layers 0..k ] --act(B/M,..)--> [ layers k+1..j ] --act--> [ layers j+1.. ] -> loss_fn(out, y)
                         <--grad of act--                 <--grad--

This module holds the stage (what one rank owns and how it talks to its neighbours); the schedules (GPipe,
1F1B, their timelines and bubble) are in ``pipeline_schedules.py`` and re-exported here, so that
``minifsdp.parallel.pipelining`` offers what ``torch.distributed.pipelining`` does.

Names and call signatures mirror ``torch.distributed.pipelining`` so a student can diff the two:
``PipelineStage(submodule, stage_index, num_stages, device, group=None)`` with ``forward_one_chunk`` /
``backward_one_chunk`` / ``scale_grads``, as torch's (ours take one tensor where torch's take a tuple of
args and kwargs).

Note (messages): a forward message is a small int64 header ``[dtype code, ndim, d0, d1, ...]`` then the
activation itself, both sent with ``dist.isend`` to the next stage's rank, received with a blocking
``dist.recv``.  Every ``isend`` must meet its ``recv`` on the peer: on gloo the sender's ``wait`` (done at the
end of each step, :meth:`PipelineStage.wait_sends`) blocks until the peer has received, so a schedule that
skips a receive hangs until the group's timeout instead of finishing wrong.  The backward message is the
gradient of that activation, whose shape the receiver already knows, so it needs no header.  torch
instead infers the shapes once before the first step ("metadata inference", a forward on the first
micro-batch plus object messages); a header per message is simpler to read and costs 64 bytes.  One tensor
crosses each cut; tuple outputs are not supported (torch allows them).

Note (recorded actions): every stage records what it did, in order, as ``stage.actions`` (``["F0", "F1",
"B0", ...]``) and with wall-clock times (``time.time()``, comparable across processes of one machine) in
``stage.events`` as ``(action, start, end)`` covering the computation only, not the waiting for a neighbour.
:func:`measured_bubble_fraction` turns the events of all stages into the idle share, to set beside
:func:`bubble_fraction`.  ``stage.peak_in_flight`` is the most micro-batches whose activations this stage held
at once and ``stage.peak_activation_bytes`` the bytes autograd had saved for them at that point (parameters
excluded), measured with ``torch.autograd.graph.saved_tensors_hooks``.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
import torch.nn as nn

from minifsdp.parallel.pipeline_schedules import (
    PipelineScheduleSingle,
    Schedule1F1B,
    ScheduleGPipe,
    action_order,
    bubble_fraction,
    format_timeline,
    measured_bubble_fraction,
    simulate_timeline,
)

__all__ = ["PipelineStage", "ScheduleGPipe", "Schedule1F1B", "PipelineScheduleSingle", "bubble_fraction",
           "measured_bubble_fraction", "action_order", "simulate_timeline", "format_timeline"]

_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.bool]
_HEADER_LEN = 8  # dtype code, ndim, up to 6 dims


class PipelineStage:
    """One rank's piece of the pipeline: ``submodule`` is stage ``stage_index`` of ``num_stages``.

    Args:
        submodule: the layers of this stage; its forward takes one tensor and returns one tensor
            (the first stage takes the model's input, the last returns what ``loss_fn`` reads).
        stage_index: this stage's place, 0 .. num_stages-1; it is also this rank's rank in ``group``.
        num_stages: the number of stages; must equal the size of ``group`` (one stage per rank, as torch's
            single-stage schedules ``ScheduleGPipe`` / ``Schedule1F1B``).
        device: where the stage computes and where received tensors are placed.
        group: the pipeline's process group (default: the world); stage ``i`` talks to group ranks i-1, i+1.
    """

    def __init__(self, submodule: nn.Module, stage_index: int, num_stages: int, device, group=None):
        if not isinstance(submodule, nn.Module):
            raise TypeError(f"submodule must be an nn.Module, got {type(submodule).__name__}")
        if num_stages < 1 or not 0 <= stage_index < num_stages:
            raise ValueError(f"stage_index={stage_index} is not in 0..num_stages-1 (num_stages={num_stages})")
        self.group = group if group is not None else dist.group.WORLD
        group_size = dist.get_world_size(self.group)
        if group_size != num_stages:
            raise ValueError(f"num_stages={num_stages} but the pipeline group has {group_size} ranks: this "
                             "implementation (like torch's single-stage schedules) puts one stage on each rank")
        group_rank = dist.get_rank(self.group)
        if group_rank != stage_index:
            raise ValueError(f"stage_index={stage_index} created on group rank {group_rank}: stage i must live "
                             "on rank i of the pipeline group")
        self.submod = submodule
        self.stage_index = stage_index
        self.num_stages = num_stages
        self.device = torch.device(device)
        self.is_first = stage_index == 0
        self.is_last = stage_index == num_stages - 1
        self.prev_rank = None if self.is_first else dist.get_global_rank(self.group, stage_index - 1)
        self.next_rank = None if self.is_last else dist.get_global_rank(self.group, stage_index + 1)
        self.has_backward = True  # set by the schedule: False when it has no loss_fn (forward only, no_grad)
        self.actions: list[str] = []
        self.events: list[tuple[str, float, float]] = []
        self.clear_runtime_states()

    # ---- one micro-batch forward / backward -------------------------------------------------------------
    def forward_one_chunk(self, chunk_id: int, x: torch.Tensor | None = None) -> torch.Tensor:
        """Forward micro-batch ``chunk_id``: take ``x`` (first stage) or receive it, run, send the output on.

        The received activation becomes a leaf with ``requires_grad=True`` so that the backward can hand
        its gradient back to the previous stage.  Returns this stage's output for the micro-batch.
        """
        if chunk_id in self._cache:
            raise RuntimeError(f"stage {self.stage_index}: micro-batch {chunk_id} was already forwarded this step")
        if self.is_first:
            if x is None:
                raise ValueError("the first stage needs its micro-batch input")
            inp = x.to(self.device)
        else:
            inp = self._recv_activation()
            if inp.is_floating_point():
                inp.requires_grad_(True)
        saved = [0]
        param_storages = {p.untyped_storage().data_ptr() for p in self.submod.parameters()}

        def pack(t):
            if t.untyped_storage().data_ptr() not in param_storages:
                saved[0] += t.numel() * t.element_size()
            return t

        start = time.time()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.set_grad_enabled(self.has_backward):
            out = self.submod(inp)
        end = time.time()
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"stage {self.stage_index} returned {type(out).__name__}: a stage must return one "
                            "tensor (the activation sent to the next stage, or the last stage's output)")
        self._record(f"F{chunk_id}", start, end)
        if not self.has_backward:  # forward only (a schedule without loss_fn): keep nothing for a backward
            if not self.is_last:
                self._send_activation(out.detach())
            return out
        self._cache[chunk_id] = (inp, out, saved[0])
        self._bytes_in_flight += saved[0]
        self.peak_in_flight = max(self.peak_in_flight, len(self._cache))
        self.peak_activation_bytes = max(self.peak_activation_bytes, self._bytes_in_flight)
        if not self.is_last:
            self._send_activation(out.detach())
        return out

    def backward_one_chunk(self, chunk_id: int, loss: torch.Tensor | None = None) -> None:
        """Backward micro-batch ``chunk_id``: from ``loss`` (last stage) or from the received output gradient.

        Parameter gradients accumulate into ``.grad`` across micro-batches (autograd adds); the gradient of
        this stage's input is sent to the previous stage.
        """
        if chunk_id not in self._cache:
            raise RuntimeError(f"stage {self.stage_index}: backward of micro-batch {chunk_id} before its forward")
        inp, out, nbytes = self._cache.pop(chunk_id)
        if self.is_last:
            if loss is None:
                raise ValueError("the last stage's backward needs the micro-batch's loss")
            roots, grads = [loss], None
        else:
            grad_out = torch.empty(out.shape, dtype=out.dtype, device=self.device)
            dist.recv(grad_out, src=self.next_rank, group=self.group)
            roots, grads = [out], [grad_out]
        start = time.time()
        torch.autograd.backward(roots, grad_tensors=grads)
        end = time.time()
        self._record(f"B{chunk_id}", start, end)
        self._bytes_in_flight -= nbytes
        if not self.is_first and inp.requires_grad:
            self._isend(inp.grad)

    def scale_grads(self, grad_scale_factor: int) -> None:
        """Divide every ``.grad`` of the stage by ``grad_scale_factor`` (as torch's: once, after the last backward)."""
        if grad_scale_factor != 1:
            for p in self.submod.parameters():
                if p.grad is not None:
                    p.grad.div_(grad_scale_factor)

    def clear_runtime_states(self) -> None:
        """Forget the last step's cached micro-batches, records and pending sends (called at each step's start)."""
        self._cache: dict[int, tuple[torch.Tensor, torch.Tensor, int]] = {}
        self._pending: list[tuple[object, torch.Tensor]] = []
        self._bytes_in_flight = 0
        self.peak_in_flight = 0
        self.peak_activation_bytes = 0
        self.output_chunks: list[torch.Tensor] = []
        self.actions = []
        self.events = []

    def wait_sends(self) -> None:
        """Wait for every ``isend`` this step started (their buffers must live until then)."""
        for work, _ in self._pending:
            work.wait()
        self._pending = []

    @property
    def in_flight(self) -> int:
        """Micro-batches forwarded but not yet backwarded on this stage."""
        return len(self._cache)

    # ---- messages ----------------------------------------------------------------------------------------
    def _record(self, action: str, start: float, end: float) -> None:
        self.actions.append(action)
        self.events.append((action, start, end))

    def _isend(self, t: torch.Tensor, dst: int | None = None) -> None:
        t = t.contiguous()
        dst = self.prev_rank if dst is None else dst
        self._pending.append((dist.isend(t, dst=dst, group=self.group), t))

    def _send_activation(self, act: torch.Tensor) -> None:
        if act.dtype not in _DTYPES or act.dim() > _HEADER_LEN - 2:
            raise TypeError(f"stage {self.stage_index}: cannot send an activation of dtype {act.dtype} "
                            f"and {act.dim()} dims (supported: {_DTYPES}, at most {_HEADER_LEN - 2} dims)")
        header = torch.zeros(_HEADER_LEN, dtype=torch.int64)
        header[0], header[1] = _DTYPES.index(act.dtype), act.dim()
        header[2:2 + act.dim()] = torch.tensor(act.shape, dtype=torch.int64)
        self._isend(header.to(self.device), dst=self.next_rank)
        self._isend(act, dst=self.next_rank)

    def _recv_activation(self) -> torch.Tensor:
        header = torch.empty(_HEADER_LEN, dtype=torch.int64, device=self.device)
        dist.recv(header, src=self.prev_rank, group=self.group)
        header = header.cpu().tolist()
        dtype, ndim = _DTYPES[header[0]], header[1]
        act = torch.empty(header[2:2 + ndim], dtype=dtype, device=self.device)
        dist.recv(act, src=self.prev_rank, group=self.group)
        return act
