"""Chapters 1 and 4.4: model parallelism built from scratch, beside data parallelism.

    tensor_parallel.py   ch 4.4  Megatron-style column / row parallel layers and parallelize_module
    pipelining.py        ch 1, 4.4  pipeline stages and their schedules (GPipe, 1F1B)

Both are written on torch.distributed's point-to-point and collective calls and checked against
torch's own ``torch.distributed.tensor.parallel`` and ``torch.distributed.pipelining`` on CPU gloo.
"""

from minifsdp.parallel import pipelining, tensor_parallel
from minifsdp.parallel.pipelining import (
    PipelineScheduleSingle,
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    action_order,
    bubble_fraction,
    format_timeline,
    measured_bubble_fraction,
    simulate_timeline,
)
from minifsdp.parallel.tensor_parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    TPShard,
    copy_to_tensor_parallel,
    full_tensor,
    parallelize_module,
    reduce_from_tensor_parallel,
)

__all__ = [
    "tensor_parallel", "ColwiseParallel", "RowwiseParallel", "ParallelStyle", "TPShard", "parallelize_module",
    "full_tensor", "copy_to_tensor_parallel", "reduce_from_tensor_parallel",
    "pipelining", "PipelineStage", "PipelineScheduleSingle", "ScheduleGPipe", "Schedule1F1B",
    "action_order", "bubble_fraction", "measured_bubble_fraction", "simulate_timeline", "format_timeline",
]
