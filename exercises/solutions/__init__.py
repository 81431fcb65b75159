"""The exercises' answers that are not minifsdp's own code, in one place.

Most tasks are graded against the library itself (the ring is ``minifsdp/comm/ring.py``, the
prefetch order ``minifsdp/fsdp/core/prefetch.py``, the checkpoint pieces
``minifsdp/checkpoint/pieces.py``, ...).  The answers below are written only for the exercises:
read them after you are done.

    fsdp_ops.py          2.1a-c  flatten and shard, unflatten, the reduce-scatter of a gradient, the clip
    corrected_call.py    2.5b    the corrected torch FSDP1 call of the source's section 2.5
    consolidate.py       3.1     a plain state dict from every rank's flat shards
    mixed_precision.py   4.1b    one unit's gradient reduction under mixed precision, ranks simulated
"""
