"""Chapter 2.3: where the bytes go, measured and predicted.

    tracker.py           MemoryTracker: bytes per rank measured from tensor storages, by category
    census.py            live_tensor_bytes(): an independent count of every live tensor (and the RSS)
    zero_formulas.py     the ZeRO paper's model-state formulas (16Ψ, 4Ψ + 12Ψ/N, ...) and their plots
    activation_sizes.py  the source's per-layer activation hook, fixed for tuple outputs
"""

from minifsdp.memory.census import live_tensor_bytes, rss_bytes
from minifsdp.memory.tracker import MemoryTracker, snapshot, without_resident
from minifsdp.memory.zero_formulas import model_state_bytes

__all__ = ["MemoryTracker", "snapshot", "without_resident", "model_state_bytes", "live_tensor_bytes", "rss_bytes"]
