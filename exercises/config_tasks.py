"""Tasks 2.5b and 3.1: the corrected FSDP call; a plain state dict from every rank's flat shards.

* 2.5b :func:`corrected_fsdp_kwargs` and :func:`apply_checkpointing`: what the source's
  ``FSDP(model, mixed_precision=True, activation_checkpointing=True)`` meant, as a call
  torch's ``FullyShardedDataParallel`` accepts (chapter 2 §2.5).
* 3.1 :func:`consolidate_state_dict`: the plain state dict rank 0 saves for serving, built
  from every rank's flat shard of each unit and the unit's layout.

The task text and hints are in ``exercises/README_config.md``.  Grade with::

    pytest tests/exercises/test_config_exercises.py --impl=student      # or -k 3_1 for one task

Reference solution: ``exercises/solutions/config_tasks.py`` (read it after you are done).
"""

from __future__ import annotations

import torch


def corrected_fsdp_kwargs(block_cls: type) -> dict:
    """Task 2.5b.  Keyword arguments for ``FullyShardedDataParallel(model, **kwargs)``.

    FULL_SHARD; one FSDP unit per ``block_cls`` (a transformer auto-wrap policy); bf16 mixed
    precision (compute, gradient reduction and buffers in bfloat16); backward prefetch
    BACKWARD_PRE; ``device_id`` the CPU.  No ``activation_checkpointing`` key: it is no FSDP argument.
    """
    raise NotImplementedError("Task 2.5b: corrected_fsdp_kwargs -- see exercises/README_config.md")


def apply_checkpointing(model: torch.nn.Module, block_cls: type) -> torch.nn.Module:
    """Task 2.5b.  Apply activation checkpointing to every ``block_cls`` in ``model`` (in place); return it."""
    raise NotImplementedError("Task 2.5b: apply_checkpointing -- see exercises/README_config.md")


def consolidate_state_dict(units: list[dict], shards: list[list[torch.Tensor]], buffers: dict[str, torch.Tensor],
                           tied: dict[str, str]) -> dict[str, torch.Tensor]:
    """Task 3.1.  The plain (unsharded) state dict, from every rank's flat shards.

    Args:
        units: one layout per FSDP unit: ``{"names": [...], "shapes": [...], "numel": total}``,
            the parameters in the order they were flattened (fully-qualified names of the
            plain model).
        shards: ``shards[u][r]``: rank r's 1-D shard of unit u's flat parameter; every rank's
            shard has the same length, the last ones end in padding zeros.
        buffers: the model's buffers by name (every rank holds them whole): saved as they are.
        tied: ``{alias: name}`` for a parameter flattened once under ``name`` but also in the
            plain state dict as ``alias`` (TinyGPT's ``lm_head.weight`` is ``tok_emb.weight``).

    Returns ``{name: tensor}`` with each tensor of its own shape, a copy (not a view of a shard).
    """
    raise NotImplementedError("Task 3.1: consolidate_state_dict -- see exercises/README_config.md")
