"""The corrected torch FSDP1 call of chapter 2 §2.5 (the answer to exercise 2.5b).

The source passes ``mixed_precision=True`` and ``activation_checkpointing=True`` to FSDP and
names ``BWD_PRE``; these two functions say what it meant: keyword arguments for
``FullyShardedDataParallel`` and activation checkpointing applied separately.
"""

from __future__ import annotations

import functools

import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing
from torch.distributed.fsdp import BackwardPrefetch, MixedPrecision, ShardingStrategy
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy


def corrected_fsdp_kwargs(block_cls: type) -> dict:
    """FULL_SHARD, bf16 compute/reduce/buffers, BACKWARD_PRE, one unit per ``block_cls``, on the CPU."""
    return dict(
        sharding_strategy=ShardingStrategy.FULL_SHARD,
        auto_wrap_policy=functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={block_cls}),
        mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16,
                                       buffer_dtype=torch.bfloat16),
        backward_prefetch=BackwardPrefetch.BACKWARD_PRE,
        device_id=torch.device("cpu"),
    )


def apply_checkpointing(model: torch.nn.Module, block_cls: type) -> torch.nn.Module:
    """Wrap every ``block_cls`` submodule of ``model`` in a checkpoint wrapper (in place); return ``model``."""
    apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, block_cls))
    return model
