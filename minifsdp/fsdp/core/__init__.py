"""FSDP's algorithm, readable in one sitting (chapters 2 and 4.1).  The one reading order:

    flat_param.py       ch 2.1: the idea: flatten, pad, shard, unflatten views (it imports no other module here)
    fsdp.py             one training step, top to bottom (wrap, forward, backward, end, optimizer)
    strategy.py         a strategy as data: ShardingPlan.of(strategy), its groups, its divide factors
    handle.py           a unit's parameters: all-gather, views, free
    gradient.py         a unit's gradient: reduce-scatter / all-reduce, divide, accumulate, no_sync
    prefetch.py         ch 2.5: which unit's all-gather to start early, and the all-gather limit
    extension.py        the one interface torch's wider API plugs into, at nine fixed points
    wrap.py             ch 2.5: auto-wrap policies
    mixed_precision.py  ch 4.1: MixedPrecision: the dtypes a unit gathers, computes and reduces in
    units.py            what an FSDP unit is; list the units; the plain model's names
    state.py            the three state machines side by side (each enum lives with its owner)

After the idea, each module imports only the modules listed below it (and ``flat_param.py``, ``minifsdp.comm``):
read from the top, and every name a file uses is explained further down.  ``minifsdp.FSDP``
(``minifsdp/fsdp/fully_sharded.py``) is this core's class with the rest of torch FSDP1's API as extensions;
what you do with a sharded model besides training it (``summon_full_params``, ``clip_grad_norm_``, the full
state dict) is ``minifsdp/fsdp/full_params.py``, on top of this core.

Where torch keeps the same steps, all in ``torch/distributed/fsdp/``: the class in
``fully_sharded_data_parallel.py``; wrapping and process groups in ``_init_utils.py`` and ``wrap.py``;
the hooks of the step in ``_runtime_utils.py``; the handle (flatten, shard, all-gather, free) in
``_flat_param.py``; the prefetch order in ``_exec_order_utils.py`` and the all-gather limit in
``_limiter_utils.py``; the states in ``_common_utils.py``.  Our files name the functions they mirror.
"""

from minifsdp.fsdp.core.extension import Extension
from minifsdp.fsdp.core.flat_param import FlatParamLayout, build_layout, flatten, shard, unflatten
from minifsdp.fsdp.core.fsdp import FullyShardedDataParallel
from minifsdp.fsdp.core.mixed_precision import MixedPrecision
from minifsdp.fsdp.core.prefetch import BackwardPrefetch
from minifsdp.fsdp.core.strategy import ShardingPlan, ShardingStrategy
from minifsdp.fsdp.core.wrap import transformer_auto_wrap_policy

__all__ = ["FullyShardedDataParallel", "ShardingStrategy", "ShardingPlan", "BackwardPrefetch", "MixedPrecision",
           "Extension", "transformer_auto_wrap_policy", "FlatParamLayout", "build_layout",
           "flatten", "shard", "unflatten"]
