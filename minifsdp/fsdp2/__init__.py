"""Chapter 5: per-parameter sharding, FSDP2's design (``fully_shard``), built from scratch.

FSDP1 (``minifsdp.fsdp``) flattens a unit's parameters into one flat parameter and shards that;
FSDP2 shards every parameter on its own along dim 0 and keeps the original parameters, each one a torch
``DTensor`` (``Shard(0)`` on the device mesh) over this rank's rows, so torch's own functions (gradient
clipping, the grad scaler, optimizers, ``state_dict`` and DCP) treat it as one piece of a whole, as they do
torch's.  The sharding itself is ours: one all-gather per group into one buffer, copy-out, one reduce-scatter,
the hooks and the prefetching.  Checked against torch's ``torch.distributed.fsdp.fully_shard`` on CPU gloo
(tests/test_fsdp2.py): losses, every local shard, every full tensor and the order of the collectives equal
bitwise, at 2, 3 and 4 ranks, with uneven shards, ``reshard_after_forward`` False / int, gradient
accumulation, bf16 mixed precision, explicit prefetch and HSDP on a 2-D mesh; and by torch's own test matrices
(tests/torch_suite/fsdp2, ``python -m minifsdp torch-suite``).

    param.py            one sharded parameter: padded dim-0 rows under a torch DTensor (``Shard(0)``) label
    nest.py             the tensors inside inputs and outputs (tuples, dicts, namedtuples, dataclasses)
    param_group.py      the parameters of one call: one all-gather, one reduce-scatter, state enums
    extensions.py       all-gather extensions (``fsdp_pre/post_all_gather``): several inputs and dtypes per group
    state.py            one call's state and hooks; the root's lazy init and end of backward
    api.py              ``FSDPModule``'s methods (unshard, reshard, the setters), ``register_fsdp_forward_method``
    fully_shard.py      ``fully_shard(module or [modules])``: what it takes, checks and changes
    mixed_precision.py  ``MixedPrecisionPolicy``, ``CPUOffloadPolicy`` and the gradient divide rule
"""

from minifsdp.fsdp2.api import FSDPModule, UnshardHandle, register_fsdp_forward_method
from minifsdp.fsdp2.fully_shard import fully_shard
from minifsdp.fsdp2.mixed_precision import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from minifsdp.fsdp2.param import ShardedState
from minifsdp.fsdp2.param_group import TrainingState

__all__ = ["fully_shard", "FSDPModule", "UnshardHandle", "register_fsdp_forward_method", "MixedPrecisionPolicy",
           "OffloadPolicy", "CPUOffloadPolicy", "ShardedState", "TrainingState"]
