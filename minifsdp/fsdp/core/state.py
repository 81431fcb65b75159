"""Three small state machines: where a unit is in its step, what its parameters hold, where its gradient is.

FSDP's hooks fire from autograd in an order the user's model decides; each state says
what a hook may do next (as torch FSDP2's ``TrainingState``).

A unit's step (``FullyShardedDataParallel.training_state``):

    IDLE --forward--> FORWARD --outputs need grad--> AWAITING_BACKWARD
                        |                                  | pre-backward hook (autograd reached its outputs)
                        +--no grad: back to IDLE           v
                                                      PRE_BACKWARD --post-backward hook--> POST_BACKWARD
    root's final callback (end of backward): every unit --> IDLE
    summon_full_params: IDLE --> SUMMON_FULL_PARAMS --> IDLE

Its parameters (``FlatParamHandle.state``):

    SHARDED --start_unshard--> GATHERING --wait_unshard--> UNSHARDED --reshard--> SHARDED

Its gradient (``UnitGradient.state``):

    SHARD --backward, synced--> REDUCING --finish_reduce--> SHARD
      |                                                       ^
      +--backward inside no_sync()--> UNSHARDED --next synced backward--+
"""

from enum import Enum, auto


class TrainingState(Enum):
    IDLE = auto()  # between steps: the local shard only (the root may keep its full parameters)
    FORWARD = auto()  # inside its forward: full parameters gathered, the module's names point into them
    AWAITING_BACKWARD = auto()  # forward done, outputs need a gradient; parameters freed again (FULL_SHARD)
    PRE_BACKWARD = auto()  # autograd reached its outputs: parameters gathered again, its gradient computing
    POST_BACKWARD = auto()  # its full gradient went to the reduce-scatter
    SUMMON_FULL_PARAMS = auto()  # inside summon_full_params: full parameters, outside autograd


class HandleState(Enum):
    SHARDED = auto()  # the full buffer's storage is 0 bytes: this rank holds its 1/N shard only
    GATHERING = auto()  # an all-gather into the full buffer is in flight (e.g. a prefetch)
    UNSHARDED = auto()  # the full buffer holds every rank's shard: the whole flat parameter


class GradState(Enum):
    SHARD = auto()  # in flat_param.grad as this rank's reduced shard (or None): what the optimizer steps
    UNSHARDED = auto()  # whole, summed over no_sync backwards, shown as flat_param.grad
    REDUCING = auto()  # a reduce-scatter (NO_SHARD: all-reduce) of the whole gradient is in flight
