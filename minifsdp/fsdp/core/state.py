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

Its gradient (``FlatParamHandle.grad_state``):

    SHARD --backward, synced--> REDUCING --finish_reduce--> SHARD
      |                                                       ^
      +--backward inside no_sync()--> UNSHARDED --next backward's pre-backward--+
"""

from __future__ import annotations

from enum import Enum, auto

__all__ = ["TrainingState", "HandleState", "GradState"]


class TrainingState(Enum):
    """A unit's place in the step."""

    IDLE = auto()
    """Between steps: the local shard only (the root may keep its full parameters)."""
    FORWARD = auto()
    """Inside its forward: full parameters gathered, the module's names point into them."""
    AWAITING_BACKWARD = auto()
    """Forward done, outputs need a gradient; parameters freed again (FULL_SHARD), activations alive."""
    PRE_BACKWARD = auto()
    """Autograd reached its outputs: full parameters gathered again, its gradient is being computed."""
    POST_BACKWARD = auto()
    """Its full gradient went to the reduce-scatter; only the reduced shard will remain."""
    SUMMON_FULL_PARAMS = auto()
    """Inside ``summon_full_params``: full parameters, outside autograd, edits written back on exit."""


class HandleState(Enum):
    """What a unit's full (unsharded) flat buffer holds."""

    SHARDED = auto()
    """The full buffer's storage is 0 bytes: this rank holds its 1/N shard only."""
    GATHERING = auto()
    """An all-gather into the full buffer is in flight (e.g. a prefetch)."""
    UNSHARDED = auto()
    """The full buffer holds every rank's shard: the whole flat parameter."""


class GradState(Enum):
    """Where a unit's gradient lives."""

    SHARD = auto()
    """In ``flat_param.grad`` as this rank's reduced shard (or None): what the optimizer steps."""
    UNSHARDED = auto()
    """Whole, summed by autograd over ``no_sync`` backwards, shown as ``flat_param.grad``."""
    REDUCING = auto()
    """A reduce-scatter (NO_SHARD: all-reduce) of the whole gradient is in flight."""
