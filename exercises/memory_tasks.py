"""Tasks 2.3a-b and 2.4: model-state bytes per rank (the ZeRO stages, then our FSDP exactly), and the
bytes one rank sends per training step under DDP and each FSDP strategy.

* 2.3a :func:`model_state_bytes_per_rank`: the ZeRO paper's mixed-precision Adam model state.
* 2.3b :func:`fsdp_model_state_bytes_per_rank`: what our FSDP really holds per rank with fp32
  AdamW, graded against the bytes measured from the tensors after a training step.
* 2.4 :func:`bytes_sent_per_rank`: graded against the bytes our ring collectives count
  (``minifsdp.count_bytes()``) in one training step, on every rank, at 2 and 3 ranks.

The task text and hints are in ``exercises/README_memory.md``.  Grade with::

    pytest tests/exercises/test_memory_exercises.py --impl=student      # or -k 2_3a for one task

Reference solution: ``minifsdp.memory.zero_formulas.model_state_bytes``,
``fsdp_model_state_bytes`` and ``bytes_sent_per_step`` (read them after you are done).
"""

from __future__ import annotations


def model_state_bytes_per_rank(num_params: int, world_size: int, stage: int) -> float:
    """Task 2.3a.  Bytes of model state per rank for mixed-precision Adam under ZeRO ``stage``.

    ``num_params`` is Ψ, ``world_size`` is N, ``stage`` is 0 (DDP), 1, 2 or 3 (FSDP FULL_SHARD);
    any other stage: raise ValueError.  fp16 parameters (2 bytes), fp16 gradients (2 bytes) and
    12 bytes of fp32 optimizer state (master copy, m, v) per parameter; stage k shards the
    optimizer state (k >= 1), the gradients (k >= 2), the parameters (k = 3) over the N ranks.
    """
    raise NotImplementedError("Task 2.3a: model_state_bytes_per_rank -- see exercises/README_memory.md")


def fsdp_model_state_bytes_per_rank(unit_numels: list[int], world_size: int) -> int:
    """Task 2.3b.  Bytes of model state one rank of our FSDP holds between steps, fp32 AdamW, exactly.

    ``unit_numels``: the number of elements of each FSDP unit's flat parameter (unpadded), e.g.
    ``[4160, 12704, 12704]`` for TinyGPT with its two blocks wrapped.  Count what the tensors hold:
    parameters, gradients and AdamW's state after ``optimizer.step()`` (FULL_SHARD or SHARD_GRAD_OP:
    both are fully sharded between steps).  Two things the 16Ψ/N formula leaves out: see the README.
    """
    raise NotImplementedError("Task 2.3b: fsdp_model_state_bytes_per_rank -- see exercises/README_memory.md")


def bytes_sent_per_rank(unit_numels: list[int], world_size: int, strategy: str, itemsize: int = 4,
                        rank: int = 0) -> int:
    """Task 2.4.  Bytes rank ``rank`` sends through our ring collectives in one training step.

    ``unit_numels``: each unit's flat-parameter numel (unpadded), the root unit first;
    ``strategy``: ``"DDP"``, ``"FULL_SHARD"``, ``"SHARD_GRAD_OP"`` or ``"NO_SHARD"`` (anything
    else: ValueError); ``itemsize``: bytes per element (4 for fp32).  One step is forward,
    backward and ``optimizer.step()``.  What each strategy sends, and what the count does not
    include, is in the README.
    """
    raise NotImplementedError("Task 2.4: bytes_sent_per_rank -- see exercises/README_memory.md")
