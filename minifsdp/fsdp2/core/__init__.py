"""Chapter 5: fully_shard's algorithm, FSDP2's per-parameter sharding, readable in one sitting.

Read in this order; each module imports only those above it (torch's file it mirrors, in
``torch/distributed/fsdp/_fully_shard/``, on the right)::

    param.py          one parameter: its Shard(0) rows, padding, DTensor label       _fsdp_param.py
    collectives.py    one group's all-gather (copy-in, copy-out), reduce-scatter      _fsdp_collectives.py
    plugin.py         the six points where the layer above plugs in                   (ours)
    nest.py           the tensors inside nested inputs and outputs                    fsdp/_common_utils.py
    param_group.py    a group: unshard, reshard, the four hooks' bodies, prefetch     _fsdp_param_group.py
    state.py          the module hooks, the root's lazy init, the end of backward      _fsdp_state.py
    fully_shard.py    one call: take the parameters, make the group and the state     _fully_shard.py

One step, hook by hook: the picture atop ``param_group.py``, checked against a recorded step of ours and of torch's
(``tests/test_step_picture.py``).  Checked bitwise against torch's ``fully_shard`` (tests/test_fsdp2.py).

Torch's wider API (HSDP, offload, shard_placement_fn, all-gather extensions, set_*) is above, in minifsdp/fsdp2/.
"""

from minifsdp.fsdp2.core.collectives import AllGatherResult, foreach_all_gather, foreach_reduce, gradient_divide_factors
from minifsdp.fsdp2.core.fully_shard import managed_params, shard_modules
from minifsdp.fsdp2.core.param import FSDPParam, MixedPrecisionPolicy, ShardedState, chunk_rows, local_row_range
from minifsdp.fsdp2.core.param_group import FSDPParamGroup, MeshInfo, TrainingState
from minifsdp.fsdp2.core.plugin import Plugin
from minifsdp.fsdp2.core.state import FSDPState, fsdp_state

__all__ = ["shard_modules", "managed_params", "FSDPParam", "FSDPParamGroup", "FSDPState", "fsdp_state", "MeshInfo",
           "MixedPrecisionPolicy", "ShardedState", "TrainingState", "Plugin", "AllGatherResult",
           "foreach_all_gather", "foreach_reduce", "gradient_divide_factors", "chunk_rows", "local_row_range"]
