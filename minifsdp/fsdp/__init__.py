"""Chapters 2 and 4.1: Fully Sharded Data Parallel.

    core/               FSDP's algorithm, read in one sitting: one step top to bottom, a strategy as
                        data, flat parameters, prefetch, MixedPrecision, no_sync, clipping,
                        summon_full_params, the full state dict (``core/__init__.py`` gives the order)

The rest is torch FSDP1's wider API, built on the core (the core never imports it); it joins each
unit as extensions, at the fixed points of ``core/extension.py``:

    fully_sharded.py    FullyShardedDataParallel: the class users import, every torch keyword
    torch_extension.py  the TorchExtension: ignored parameters, wrap-time checks, dtype changes,
                        requires_grad changed after wrapping, a step between a forward and its backward
    orig_params.py      use_orig_params=True: the original parameters stay, views of the shard
    backward_extras.py  a frozen unit's reshard; freeing a unit's parameters before its gradient's concat
    torch_options.py    torch's constructor keywords (device_mesh, cpu_offload, ignored_modules, ...) mapped
    deferred_init.py    a model built on the meta device; sync_module_states
    dtype_change.py     model.half() / .to(dtype) after wrapping
    checks.py           bad input at wrap and step time: devices, weights that differ across ranks, a stale
                        optimizer, a weight tied across units
    full_state_dict.py  the full state dict one unit at a time, as torch; loading one into the shards
    pitfalls.py         ch 6: ranks that wrap differently, a load between forward and backward, HYBRID over 1
    state_dict_type.py  FSDP.state_dict_type: FULL / SHARDED / LOCAL state dicts
    optim_state.py      FSDP.optim_state_dict / optim_state_dict_to_load (minifsdp.checkpoint's too)
    param_pieces.py     which numbers of which original parameter each tensor the optimizer steps holds
    grad_scaler.py      ch 4.1: ShardedGradScaler, fp16 loss scaling over shards
    activation_checkpointing.py  ch 2.3: recompute whole blocks in the backward
"""

from minifsdp.fsdp.activation_checkpointing import apply_activation_checkpointing
from minifsdp.fsdp.core import (
    BackwardPrefetch,
    FlatParamLayout,
    ShardingPlan,
    ShardingStrategy,
    build_layout,
    flatten,
    shard,
    transformer_auto_wrap_policy,
    unflatten,
)
from minifsdp.fsdp.fully_sharded import FSDP, FullyShardedDataParallel
from minifsdp.fsdp.grad_scaler import ShardedGradScaler
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
from minifsdp.fsdp.torch_options import CPUOffload, MixedPrecision, hybrid_groups, size_based_auto_wrap_policy

__all__ = [
    "FullyShardedDataParallel", "FSDP", "ShardingStrategy", "ShardingPlan", "hybrid_groups", "BackwardPrefetch",
    "MixedPrecision", "ShardedGradScaler", "apply_activation_checkpointing",
    "size_based_auto_wrap_policy", "transformer_auto_wrap_policy",
    "FlatParamLayout", "build_layout", "flatten", "shard", "unflatten",
    "StateDictType", "StateDictConfig", "FullStateDictConfig", "ShardedStateDictConfig", "LocalStateDictConfig",
    "OptimStateDictConfig", "FullOptimStateDictConfig", "ShardedOptimStateDictConfig", "LocalOptimStateDictConfig",
    "StateDictSettings", "CPUOffload",
]
