"""Chapter 5: per-parameter sharding, FSDP2's design (``fully_shard``), built from scratch.

FSDP1 (``minifsdp.fsdp``) flattens a unit's parameters into one flat parameter and shards that; FSDP2 shards every
parameter on its own along dim 0 and keeps the original parameters, each one a torch ``DTensor`` (``Shard(0)`` on
the device mesh) over this rank's rows, so torch's own functions (gradient clipping, the grad scaler, optimizers,
``state_dict`` and DCP) treat it as one piece of a whole, as they do torch's.  The sharding itself is ours: one
all-gather per group into one buffer, copy-out, one reduce-scatter, the hooks and the prefetching.  Checked against
torch's ``torch.distributed.fsdp.fully_shard`` on CPU gloo (tests/test_fsdp2.py): losses, every local shard, every
full tensor and the order of the collectives equal bitwise, at 2, 3 and 4 ranks, with uneven shards, fp16 and bf16
reductions, ``reshard_after_forward`` False / int, gradient accumulation, explicit prefetch and HSDP on a 2-D mesh;
and by torch's own test matrices (tests/torch_suite/fsdp2, ``python -m minifsdp torch-suite``).

The algorithm is :mod:`minifsdp.fsdp2.core` (read it first; its ``__init__`` gives the reading order).  This
package is the rest of torch's API, on top of it.  Each option that changes the step is a plugin of the core's
one interface (:class:`~minifsdp.fsdp2.core.Plugin`: six fixed points of the step), chosen by ``fully_shard``::

    module            what                                                      plugs in at
    fully_shard.py    fully_shard(module or [modules], ...): torch's arguments  (chooses the plugins)
    api.py            FSDPModule's methods, register_fsdp_forward_method;
                      GradientSync: set_requires_gradient_sync(False)           before_reduce
    materialize.py    meta-device init, to_empty: replaced shards adopted       on_lazy_init
    reshard.py        reshard_after_forward=k: a smaller group after forward    before_reshard, all_gather
    extensions.py     fsdp_pre/post_all_gather, mixed dtypes in one group       after_shard, on_lazy_init,
                                                                                all_gather, before_reshard
    placement.py      shard_placement_fn: Shard(d) along another dim            after_shard, all_gather,
                                                                                before_reduce
    offload.py        OffloadPolicy, CPUOffloadPolicy                           after_shard
    hsdp.py           HSDP's all-reduce over the replicas; set_all_reduce_hook  after_reduce
    pitfalls.py       ch 6: an optimizer holding what fully_shard replaced      (fully_shard calls it)
"""

from minifsdp.fsdp2.api import FSDPModule, UnshardHandle, register_fsdp_forward_method
from minifsdp.fsdp2.core import MixedPrecisionPolicy, ShardedState, TrainingState
from minifsdp.fsdp2.fully_shard import fully_shard
from minifsdp.fsdp2.offload import CPUOffloadPolicy, OffloadPolicy

__all__ = ["fully_shard", "FSDPModule", "UnshardHandle", "register_fsdp_forward_method", "MixedPrecisionPolicy",
           "OffloadPolicy", "CPUOffloadPolicy", "ShardedState", "TrainingState"]
