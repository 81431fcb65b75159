"""The three trainers behind ``python -m minifsdp train --impl``: wrap, clip, scale, checkpoint.

(``--impl student`` is a fourth choice but no fourth trainer: it builds ours twice and plugs a
student's exercise functions into the second; ``minifsdp/classroom/student.py`` runs and compares the two.)

The job (``train.py``) runs one loop; everything that differs between our FSDP and
torch's lives here, one small function per difference:

                    ours                         torch-fsdp1                      torch-fsdp2
    wrap            minifsdp FSDP, one unit      torch FSDP1, one unit per        fully_shard on each Block,
                    per Block (transformer_      Block, device_id=cpu,            then on the root
                    auto_wrap_policy)            use_orig_params=False
    precision       MixedPrecision(bf16|fp16)    torch's MixedPrecision           MixedPrecisionPolicy
    fp16 scaler     our ShardedGradScaler        torch's ShardedGradScaler        torch's ShardedGradScaler
    clip + norm     model.clip_grad_norm_(c)     model.clip_grad_norm_(c)         nn.utils.clip_grad_norm_ over
                    (global norm, collective)    (global norm, collective)        DTensors (.full_tensor())
    checkpoint      minifsdp.checkpoint:         torch.distributed.checkpoint.state_dict:
                    sharded pieces per rank      a full state dict, rank 0 writes one file,
                    (loads at any world size)    every rank reads it back

Note (bitwise): in fp32, ours and torch FSDP1 cut the same flat shards, divide
the gradients by the same factors and reduce with the same collective, so their
losses and gradient norms agree bitwise (``tests/test_fsdp_parity.py``); at 2
ranks our ring sums two numbers, which has one rounding, so ``--collectives ring``
agrees too.  FSDP2 reduces with other factors and sums the clipping norm over
DTensors in another order: it agrees to ~1e-6, not bitwise.
"""

from __future__ import annotations

import functools
import os

import torch
import torch.distributed as dist
import torch.nn as nn

from minifsdp.models import Block

__all__ = ["IMPLS", "wrap", "make_scaler", "clip", "save_torch_checkpoint", "load_torch_checkpoint",
           "full_weights"]

IMPLS = ("ours", "torch-fsdp1", "torch-fsdp2", "student")  # student: ours with your functions (classroom/student.py)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _is_block(m: nn.Module) -> bool:
    return isinstance(m, Block)


def _process_group(strategy: str):
    if strategy == "HYBRID_SHARD":  # shard inside pairs of ranks, replicate across pairs
        from minifsdp.fsdp.torch_options import hybrid_groups

        return hybrid_groups(2)
    return None


def wrap(model: nn.Module, args, device: torch.device | None = None) -> nn.Module:
    """``model`` (on ``device``) sharded by ``args.impl`` (one unit per Block), with mixed precision and
    checkpointing; torch FSDP1 gets ``device_id=device`` (on CPU it needs one)."""
    dtype = DTYPES.get(args.mixed_precision)
    if args.impl == "student":
        raise ValueError("--impl student is a comparison job of its own: python -m minifsdp train --impl student "
                         "(minifsdp.classroom.student.run_student)")
    if args.impl == "ours":
        from minifsdp.fsdp import FSDP, MixedPrecision, apply_activation_checkpointing
        from minifsdp.fsdp.core.wrap import transformer_auto_wrap_policy

        mp = MixedPrecision(param_dtype=dtype, reduce_dtype=dtype, buffer_dtype=dtype) if dtype else None
        model = FSDP(model, process_group=_process_group(args.strategy), sharding_strategy=args.strategy,
                     collectives=args.collectives, mixed_precision=mp,
                     auto_wrap_policy=functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block}))
        if args.activation_checkpointing:
            apply_activation_checkpointing(model, check_fn=_is_block)
        return model
    if args.impl == "torch-fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel, MixedPrecision, ShardingStrategy
        from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

        mp = MixedPrecision(param_dtype=dtype, reduce_dtype=dtype, buffer_dtype=dtype) if dtype else None
        model = FullyShardedDataParallel(
            model, process_group=_process_group(args.strategy), sharding_strategy=ShardingStrategy[args.strategy],
            auto_wrap_policy=functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block}),
            mixed_precision=mp, device_id=device if device is not None else torch.device("cpu"),
            use_orig_params=False)
    elif args.impl == "torch-fsdp2":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=dtype) if dtype else MixedPrecisionPolicy()
        reshard = args.strategy == "FULL_SHARD"  # SHARD_GRAD_OP keeps the gathered parameters until backward
        for block in model.blocks:
            fully_shard(block, reshard_after_forward=reshard, mp_policy=mp)
        fully_shard(model, reshard_after_forward=reshard, mp_policy=mp)
    else:
        raise ValueError(f"--impl must be one of {', '.join(IMPLS)}, got {args.impl!r}")
    if args.activation_checkpointing:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
            CheckpointImpl,
            apply_activation_checkpointing,
            checkpoint_wrapper,
        )

        apply_activation_checkpointing(model, check_fn=_is_block, checkpoint_wrapper_fn=functools.partial(
            checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT))
    return model


def make_scaler(args):
    """fp16 needs loss scaling (its range ends at 65504); bf16 and fp32 do not (None)."""
    if args.mixed_precision != "fp16":
        return None
    if args.impl == "ours":
        from minifsdp.fsdp import ShardedGradScaler

        return ShardedGradScaler()
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    return ShardedGradScaler(device=getattr(args, "device", "cpu"))


def clip(model: nn.Module, args) -> float:
    """Clip to ``args.clip`` (none if 0) and return the GLOBAL gradient norm, the same on every rank.

    Not ``torch.nn.utils.clip_grad_norm_(model.parameters())`` on FSDP1 or ours: those
    parameters are this rank's flat shards, so it would return this rank's local norm and
    each rank would clip by its own factor (the source's mistake in 3.2).  FSDP2's
    parameters are DTensors, whose norm is global, so torch's plain function is right there.
    """
    max_norm = args.clip if args.clip > 0 else float("inf")
    if args.impl == "torch-fsdp2":
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
    return float(model.clip_grad_norm_(max_norm))


def _torch_options():
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, cpu_offload=False)


def save_torch_checkpoint(path: str, model: nn.Module, optimizer, extra) -> None:
    """torch FSDP1/FSDP2: a full state dict of model and optimizer, one file written by rank 0 (collective).

    ``extra`` is per rank (RNG states differ), so every rank's is gathered into the file.
    Written to ``path.tmp`` and renamed, so a crash leaves no half checkpoint under ``path``.
    """
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, optimizer, options=_torch_options())
    extras = [None] * dist.get_world_size()
    dist.all_gather_object(extras, extra)
    if dist.get_rank() == 0:
        tmp = path + ".tmp"
        os.makedirs(tmp, exist_ok=True)
        torch.save({"model": msd, "optim": osd, "extra": extras}, os.path.join(tmp, "torch_full.pt"))
        os.replace(tmp, path)
    dist.barrier()


def load_torch_checkpoint(path: str, model: nn.Module, optimizer):
    """Every rank reads the full file and keeps its own shards; returns this rank's ``extra``."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    saved = torch.load(os.path.join(path, "torch_full.pt"), map_location="cpu", weights_only=False)
    set_state_dict(model, optimizer, model_state_dict=saved["model"], optim_state_dict=saved["optim"],
                   options=StateDictOptions(full_state_dict=True))
    extras = saved["extra"]
    return extras[dist.get_rank()] if len(extras) == dist.get_world_size() else extras[0]


def full_weights(model: nn.Module, impl: str) -> dict[str, torch.Tensor]:
    """The consolidated plain state dict (collective; complete on rank 0), names as the unwrapped model's."""
    if impl == "ours":
        from minifsdp.checkpoint import full_state_dict

        return full_state_dict(model, rank0_only=True)
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(model, options=_torch_options())
