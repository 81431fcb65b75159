"""The answers to tasks 2.5b and 3.1 (``exercises/config_tasks.py``).

2.5b: the corrected torch FSDP1 call of chapter 2 §2.5.  The source passes ``mixed_precision=True`` and
``activation_checkpointing=True`` to FSDP and names ``BWD_PRE``; these two functions say what it meant:
keyword arguments for ``FullyShardedDataParallel``, and activation checkpointing applied separately.

3.1: consolidation for serving, a plain state dict from every rank's flat shards.  ``units[i]``: one unit's
layout (``{"names", "shapes", "numel"}``); ``shards[i]``: that unit's flat shard from every rank, in rank
order.  Concatenate, cut the padding, cut each parameter as a view of its own numbers (cloned), give a
tied name its owner's tensor, add the buffers.
"""

from __future__ import annotations

import functools

import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing
from torch.distributed.fsdp import BackwardPrefetch, MixedPrecision, ShardingStrategy
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

__all__ = ["corrected_fsdp_kwargs", "apply_checkpointing", "consolidate_state_dict"]


def corrected_fsdp_kwargs(block_cls: type) -> dict:
    """Task 2.5b: FULL_SHARD, bf16 compute/reduce/buffers, BACKWARD_PRE, one unit per ``block_cls``, on the CPU."""
    return dict(
        sharding_strategy=ShardingStrategy.FULL_SHARD,
        auto_wrap_policy=functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={block_cls}),
        mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16,
                                       buffer_dtype=torch.bfloat16),
        backward_prefetch=BackwardPrefetch.BACKWARD_PRE,
        device_id=torch.device("cpu"),
    )


def apply_checkpointing(model: torch.nn.Module, block_cls: type) -> torch.nn.Module:
    """Task 2.5b: wrap every ``block_cls`` submodule of ``model`` in a checkpoint wrapper (in place); return it."""
    apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, block_cls))
    return model


def consolidate_state_dict(units, shards, buffers, tied):
    """Task 3.1: a plain state dict, loadable with ``strict=True`` into the unwrapped model."""
    out = {}
    if len(units) != len(shards):
        raise ValueError("one list of shards per unit")
    for layout, pieces in zip(units, shards):
        flat = torch.cat(list(pieces))[: layout["numel"]]
        offset = 0
        for name, shape in zip(layout["names"], layout["shapes"], strict=True):
            n = torch.Size(shape).numel()
            out[name] = flat[offset: offset + n].view(shape).clone()
            offset += n
    for alias, name in tied.items():
        out[alias] = out[name]
    out.update({k: v.clone() for k, v in buffers.items()})
    return out
