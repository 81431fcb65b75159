"""Chapters 2 and 4.1: Fully Sharded Data Parallel, one concept per module.

Read in this order (each module imports only those above it):

    units.py            what an FSDP unit is; list the units; the plain model's names
    state.py            a unit's and a handle's state, as enums (what each holds in memory)
    flat_param.py       ch 2.1: flatten, pad, shard, unflatten views
    sharding.py         ch 2.1: strategies, process groups, the gradient divide factors, FSDP's collectives
    grad_scaler.py      ch 4.1: ShardedGradScaler, torch's GradScaler API for sharded fp16 gradients
    mixed_precision.py  ch 4.1: MixedPrecision (the dtypes a handle gathers and reduces in)
    reduction.py        a unit's gradient: reduce-scatter / all-reduce, divide, cast, accumulate
    dtype_change.py     model.half() / .to(dtype) after wrapping: which tensors convert, when buffers follow
    handle.py           one unit's tensors and collectives: gather, free (its gradient: reduction.py)
    prefetch.py         ch 2.5: which unit's all-gather to start early, and the rate limit
    events.py           what a unit reports to an attached tracer (``tools/tracing.py`` records it)
    checks.py           bad input at wrap time: devices, weights that differ across ranks, a stale optimizer
    wrap.py             ch 2.5: auto-wrap policies
    root.py             the root unit: elected at the first forward, keeps the step's bookkeeping
    backward.py         the hooks autograd calls: pre-/post-backward, frozen units' reshard, final callback
    fully_sharded.py    FullyShardedDataParallel: the module users see; hooks, order, state
    full_params.py      summon_full_params, clip_grad_norm_, the full state dict
    state_dict_type.py  FSDP.state_dict_type: FULL / SHARDED / LOCAL state dicts (torch's enum and configs)
    optim_state.py      FSDP.optim_state_dict / optim_state_dict_to_load: optimizer state by original names
    torch_options.py    torch's constructor keywords (cpu_offload, ignored_modules, ...) mapped onto ours
    activation_checkpointing.py  ch 2.3: recompute whole blocks in the backward
    reference_ops.py    ch 2.1: flatten/shard, reduce-scatter, clip as standalone functions (exercises)
"""

from minifsdp.fsdp.activation_checkpointing import apply_activation_checkpointing
from minifsdp.fsdp.flat_param import FlatParamLayout, build_layout, flatten, shard, unflatten
from minifsdp.fsdp.fully_sharded import FSDP, FullyShardedDataParallel
from minifsdp.fsdp.mixed_precision import MixedPrecision, ShardedGradScaler
from minifsdp.fsdp.prefetch import BackwardPrefetch
from minifsdp.fsdp.sharding import ShardingStrategy, hybrid_groups
from minifsdp.fsdp.state_dict_type import (
    FullOptimStateDictConfig,
    FullStateDictConfig,
    LocalOptimStateDictConfig,
    LocalStateDictConfig,
    OptimStateDictConfig,
    ShardedOptimStateDictConfig,
    ShardedStateDictConfig,
    StateDictConfig,
    StateDictSettings,
    StateDictType,
)
from minifsdp.fsdp.torch_options import CPUOffload
from minifsdp.fsdp.wrap import size_based_auto_wrap_policy, transformer_auto_wrap_policy

__all__ = [
    "FullyShardedDataParallel", "FSDP", "ShardingStrategy", "hybrid_groups", "BackwardPrefetch",
    "MixedPrecision", "ShardedGradScaler", "apply_activation_checkpointing",
    "size_based_auto_wrap_policy", "transformer_auto_wrap_policy",
    "FlatParamLayout", "build_layout", "flatten", "shard", "unflatten",
    "StateDictType", "StateDictConfig", "FullStateDictConfig", "ShardedStateDictConfig", "LocalStateDictConfig",
    "OptimStateDictConfig", "FullOptimStateDictConfig", "ShardedOptimStateDictConfig", "LocalOptimStateDictConfig",
    "StateDictSettings", "CPUOffload",
]
