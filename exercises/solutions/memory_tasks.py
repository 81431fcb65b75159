"""The answers to tasks 2.3a-b and 2.4 (``exercises/memory_tasks.py``): ``minifsdp/memory/zero_formulas.py``."""

from minifsdp.memory.zero_formulas import bytes_sent_per_step as bytes_sent_per_rank
from minifsdp.memory.zero_formulas import fsdp_model_state_bytes as fsdp_model_state_bytes_per_rank
from minifsdp.memory.zero_formulas import model_state_bytes

__all__ = ["model_state_bytes_per_rank", "fsdp_model_state_bytes_per_rank", "bytes_sent_per_rank"]


def model_state_bytes_per_rank(num_params: int, world_size: int, stage: int) -> float:
    """Task 2.3a: the ZeRO paper's mixed-precision Adam (2 + 2 + 12 bytes per parameter) under ``stage``."""
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage is 0 (DDP), 1, 2 or 3, got {stage!r}")
    return model_state_bytes(num_params, world_size, stage, "mixed_adam")["total"]
