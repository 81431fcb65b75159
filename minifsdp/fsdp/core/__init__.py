"""FSDP's algorithm, readable in one sitting (chapters 2 and 4.1).

Read in this order; each module imports only those above it (and ``minifsdp.comm``):

    units.py            what an FSDP unit is; list the units; the plain model's names
    state.py            three enums: a unit's step, its parameters, its gradient
    flat_param.py       ch 2.1: flatten, pad, shard, unflatten views
    strategy.py         ch 2.1: the four strategies, their process groups, the gradient divide factors
    mixed_precision.py  ch 4.1: MixedPrecision: the dtypes a unit gathers, computes and reduces in
    gradient.py         a unit's gradient: reduce-scatter / all-reduce, divide, accumulate, no_sync
    handle.py           a unit's parameters: gather, views, free
    prefetch.py         ch 2.5: which unit's all-gather to start early, and the all-gather limit
    wrap.py             ch 2.5: auto-wrap policies
    full_params.py      summon_full_params, clip_grad_norm_, the full state dict
    backward.py         the hooks autograd calls: pre-backward, post-backward, the final callback
    fsdp.py             FullyShardedDataParallel: wrapping, the forward, the root

This is the FSDP a learner reads.  ``minifsdp.FSDP`` is the class users import: it extends
this one with the rest of torch FSDP1's API (``minifsdp/fsdp/fully_sharded.py``).
"""

from minifsdp.fsdp.core.flat_param import FlatParamLayout, build_layout, flatten, shard, unflatten
from minifsdp.fsdp.core.fsdp import FullyShardedDataParallel
from minifsdp.fsdp.core.mixed_precision import MixedPrecision
from minifsdp.fsdp.core.prefetch import BackwardPrefetch
from minifsdp.fsdp.core.strategy import ShardingStrategy
from minifsdp.fsdp.core.wrap import transformer_auto_wrap_policy

__all__ = ["FullyShardedDataParallel", "ShardingStrategy", "BackwardPrefetch", "MixedPrecision",
           "transformer_auto_wrap_policy", "FlatParamLayout", "build_layout",
           "flatten", "shard", "unflatten"]
