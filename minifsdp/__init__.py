"""minifsdp: Fully Sharded Data Parallel from scratch, proven against torch.

The package follows the book.  Its top level holds only what every chapter uses;
each chapter has a subpackage.  The subpackages are layers, and a module imports
only its own layer or a lower one, with no cycles (``tests/test_layout.py`` checks
both): comm < ddp < fsdp, memory, parallel < checkpoint, fsdp2 < the programs.  ``comm`` (chapter 2.2) sits
below ``ddp`` (chapter 1) because both DDP and FSDP send their gradients through it.

    launch.py, notebook.py, models.py, data/    every chapter: local ranks, %%ranks, the models, the corpus
    ddp/          ch 1    DataParallel by hand, buckets, DistributedDataParallel
    comm/         ch 2.2  the ring: naive and ring all-reduce, reduce-scatter, all-gather
    fsdp/         ch 2    flat parameters, sharding, the unit and its handle, wrapping, prefetch,
                  ch 4.1  mixed precision, activation checkpointing, full parameters and state dicts
    memory/       ch 2.3  bytes per rank measured from tensors; the ZeRO formulas
    checkpoint/   ch 4.3  save / load at any world size, atomic files, resume
    parallel/     ch 4.4  tensor parallel (column / row), pipeline schedules (GPipe, 1F1B)
    fsdp2/        ch 5    per-parameter sharding: fully_shard, FSDP2's design
    the programs around the book, one room each:
    commands/             the command line (``python -m minifsdp ...``)
    training/     ch 3    the training jobs: compare (the main job), train, generate
    bench/        ch 2    benchmarks, a ratio against torch measured in the same run
    classroom/            the course: grading, the student edition, the find-the-bug lab
    pictures/             plots for the notebooks, timelines of a step
    cells/                what the notebooks' cells call
    explorers/            the notebooks' panels a learner drives
    fuzz/         ch 6    random programs on torch's FSDP and on ours, compared bit for bit

Every name below is importable from ``minifsdp`` directly, named as in torch.
"""

from minifsdp.comm import (
    count_bytes,
    get_collectives,
    naive_all_reduce,
    ring_all_gather,
    ring_all_reduce,
    ring_reduce_scatter,
)
from minifsdp.ddp import DDP, DataParallel, DistributedDataParallel, assign_buckets
from minifsdp.fsdp import (
    FSDP,
    BackwardPrefetch,
    CPUOffload,
    FlatParamLayout,
    FullOptimStateDictConfig,
    FullStateDictConfig,
    FullyShardedDataParallel,
    LocalOptimStateDictConfig,
    LocalStateDictConfig,
    MixedPrecision,
    OptimStateDictConfig,
    ShardedGradScaler,
    ShardedOptimStateDictConfig,
    ShardedStateDictConfig,
    ShardingStrategy,
    StateDictConfig,
    StateDictSettings,
    StateDictType,
    apply_activation_checkpointing,
    build_layout,
    flatten,
    hybrid_groups,
    shard,
    size_based_auto_wrap_policy,
    transformer_auto_wrap_policy,
    unflatten,
)
from minifsdp.fsdp2 import FSDPModule, MixedPrecisionPolicy, fully_shard
from minifsdp.launch import RankFailedError, spawn
from minifsdp.memory import MemoryTracker, model_state_bytes, snapshot
from minifsdp.models import MLP, CharCorpus, GPTConfig, TinyGPT
from minifsdp.parallel import (
    ColwiseParallel,
    PipelineStage,
    RowwiseParallel,
    Schedule1F1B,
    ScheduleGPipe,
    parallelize_module,
    pipelining,
    tensor_parallel,
)

__all__ = [
    "spawn", "RankFailedError",
    "naive_all_reduce", "ring_all_reduce", "ring_reduce_scatter", "ring_all_gather", "count_bytes", "get_collectives",
    "DataParallel", "DistributedDataParallel", "DDP", "assign_buckets",
    "FullyShardedDataParallel", "FSDP", "ShardingStrategy", "hybrid_groups",
    "BackwardPrefetch", "MixedPrecision", "ShardedGradScaler", "apply_activation_checkpointing",
    "size_based_auto_wrap_policy", "transformer_auto_wrap_policy",
    "FlatParamLayout", "build_layout", "flatten", "shard", "unflatten",
    "StateDictType", "StateDictConfig", "FullStateDictConfig", "ShardedStateDictConfig", "LocalStateDictConfig",
    "OptimStateDictConfig", "FullOptimStateDictConfig", "ShardedOptimStateDictConfig", "LocalOptimStateDictConfig",
    "StateDictSettings", "CPUOffload",
    "MemoryTracker", "snapshot", "model_state_bytes",
    "TinyGPT", "GPTConfig", "MLP", "CharCorpus",
    "ColwiseParallel", "RowwiseParallel", "parallelize_module", "tensor_parallel",
    "PipelineStage", "ScheduleGPipe", "Schedule1F1B", "pipelining",
    "fully_shard", "FSDPModule", "MixedPrecisionPolicy",
]
__version__ = "0.1.0"
