"""minifsdp: Fully Sharded Data Parallel from scratch, proven against torch.

Chapters and the modules that build them (a later chapter's module may import
an earlier one's, never the reverse):

    1    launch.py          local ranks: real processes on gloo, failures surfaced
    1    notebook.py        %%ranks: a notebook cell run on N real processes
    1    data_parallel.py   torch.nn.DataParallel's recipe, by hand (and its bottleneck)
    1    buckets.py, ddp.py DistributedDataParallel from scratch
    2.2  ring.py, collectives.py, comm_stream.py, ring_sim.py
                            naive and ring all-reduce, ring reduce-scatter / all-gather
    2.1  flat_param.py      flatten, pad, shard, unflatten views
    2    sharding.py, fsdp*.py, wrap.py
                            the FSDP unit, sharding strategies, auto-wrap policies
    2.3  memory.py, zero_formulas.py, activation_sizes.py
                            bytes per rank, measured from tensors; the ZeRO formulas
    2.3  activation_checkpointing.py  recompute whole blocks in the backward
    2.5  prefetch.py, tracing.py
                            backward / forward prefetch, limit_all_gathers; event timelines
    4.1  mixed_precision.py MixedPrecision, ShardedGradScaler
    4.3  checkpoint*.py, resume.py
                            state dicts, atomic save / load, resharding (``from minifsdp import checkpoint``)
         models.py          the tiny GPT and the MLP every chapter trains
"""

from minifsdp.activation_checkpointing import apply_activation_checkpointing
from minifsdp.buckets import assign_buckets
from minifsdp.collectives import (
    count_bytes,
    get_collectives,
    naive_all_reduce,
    ring_all_gather,
    ring_all_reduce,
    ring_reduce_scatter,
)
from minifsdp.data_parallel import DataParallel
from minifsdp.ddp import DDP, DistributedDataParallel
from minifsdp.flat_param import FlatParamLayout, build_layout, flatten, shard, unflatten
from minifsdp.fsdp import FSDP, FullyShardedDataParallel
from minifsdp.launch import RankFailedError, spawn
from minifsdp.memory import MemoryTracker, snapshot
from minifsdp.mixed_precision import MixedPrecision, ShardedGradScaler
from minifsdp.models import MLP, CharCorpus, GPTConfig, TinyGPT
from minifsdp.prefetch import BackwardPrefetch
from minifsdp.sharding import ShardingStrategy, hybrid_groups
from minifsdp.wrap import size_based_auto_wrap_policy, transformer_auto_wrap_policy
from minifsdp.zero_formulas import model_state_bytes

__all__ = [
    "spawn", "RankFailedError",
    "naive_all_reduce", "ring_all_reduce", "ring_reduce_scatter", "ring_all_gather", "count_bytes", "get_collectives",
    "DataParallel", "DistributedDataParallel", "DDP", "assign_buckets",
    "FullyShardedDataParallel", "FSDP", "ShardingStrategy", "hybrid_groups",
    "BackwardPrefetch", "MixedPrecision", "ShardedGradScaler", "apply_activation_checkpointing",
    "size_based_auto_wrap_policy", "transformer_auto_wrap_policy",
    "FlatParamLayout", "build_layout", "flatten", "shard", "unflatten",
    "MemoryTracker", "snapshot", "model_state_bytes",
    "TinyGPT", "GPTConfig", "MLP", "CharCorpus",
]
__version__ = "0.1.0"
