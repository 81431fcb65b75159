"""Where a unit is in its training step, and what its handle holds in memory, as two enums.

FSDP's hooks fire from autograd in an order the user's model decides; two small
state machines (as in torch FSDP2's ``TrainingState``) say what each hook may do.

A unit's step (``FullyShardedDataParallel.training_state``):

    IDLE --forward--> FORWARD --outputs need grad--> AWAITING_BACKWARD
                        |                                  | pre-backward hook (autograd reached its outputs)
                        +--no grad: back to IDLE           v
                                                      PRE_BACKWARD --post-backward hook--> POST_BACKWARD
    root's final callback (end of backward): every unit --> IDLE
    summon_full_params: IDLE --> SUMMON_FULL_PARAMS --> IDLE

Its handle's parameters (``FlatParamHandle.state``):

    SHARDED --start_unshard--> GATHERING --wait_unshard--> UNSHARDED --reshard--> SHARDED
    (NO_SHARD: UNSHARDED, nothing to gather; with MixedPrecision the low-precision copy is cast at each use)
"""

from __future__ import annotations

from enum import Enum, auto

__all__ = ["TrainingState", "HandleState"]


class TrainingState(Enum):
    """A unit's place in the step; what it holds in memory at that point (FULL_SHARD)."""

    IDLE = auto()
    """Between steps: the local shard only (the root may keep its full parameters); no gradient in flight."""

    FORWARD = auto()
    """Inside this unit's forward: its full parameters are gathered and the module's names point into them."""

    AWAITING_BACKWARD = auto()
    """Its forward is done and its outputs need a gradient: the backward will come back for it.
    Parameters freed again (FULL_SHARD); the activations its forward saved are alive."""

    PRE_BACKWARD = auto()
    """Autograd reached its outputs: full parameters gathered again, its gradient is being computed."""

    POST_BACKWARD = auto()
    """Its full gradient was handed to the reduce-scatter and freed; only the reduced shard will remain."""

    SUMMON_FULL_PARAMS = auto()
    """Inside ``summon_full_params``: full parameters gathered, outside autograd, edits written back on exit."""


class HandleState(Enum):
    """What a handle's full (unsharded) flat buffer holds."""

    SHARDED = auto()
    """The full buffer's storage is 0 bytes: this rank holds its 1/N shard (``flat_param``) only."""

    GATHERING = auto()
    """An all-gather into the full buffer is in flight (issued asynchronously, e.g. a prefetch)."""

    UNSHARDED = auto()
    """The full buffer holds every rank's shard: the whole flat parameter, padding included."""
