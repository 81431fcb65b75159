"""Three small state machines side by side: where a unit is in its step, what its parameters hold, where its
gradient is.  Each enum lives with its owner: ``TrainingState`` in ``fsdp.py``, ``HandleState`` in ``handle.py``,
``GradState`` in ``gradient.py``; this page draws the three together (it holds no code).

FSDP's hooks fire from autograd in an order the user's model decides; each state says what a hook
may do next (as torch's ``TrainingState``).

A unit's step (``FullyShardedDataParallel.training_state``):

    IDLE --forward--> FORWARD --outputs need grad--> AWAITING_BACKWARD
                        |                                  | pre-backward hook (autograd reached its outputs)
                        +--no grad: back to IDLE           v
                                                      PRE_BACKWARD --post-backward hook--> POST_BACKWARD
    root's final callback (end of backward): every unit --> IDLE
    summon_full_params: IDLE --> SUMMON_FULL_PARAMS --> IDLE

Its parameters (``FlatParamHandle.state``, ``handle.py``):

    SHARDED --start_unshard--> GATHERING --wait_unshard--> UNSHARDED --end_use(free=True)--> SHARDED
    (a plan that keeps them, or the root after its forward: UNSHARDED until the backward's reshard)

Its gradient (``UnitGradient.state``, ``gradient.py``):

    SHARD --backward, synced--> REDUCING --finish_reduce--> SHARD
      |                                                       ^
      +--backward inside no_sync()--> UNSHARDED --next synced backward--+

One non-root FULL_SHARD unit through a synced step, its three states side by side:

    moment            training_state      FlatParamHandle.state       UnitGradient.state
    pre-forward       FORWARD             (GATHERING ->) UNSHARDED    SHARD
    post-forward      AWAITING_BACKWARD   SHARDED                     SHARD
    pre-backward      PRE_BACKWARD        (GATHERING ->) UNSHARDED    SHARD
    post-backward     POST_BACKWARD       SHARDED                     REDUCING (a GPU's: until the next
    final callback    IDLE                SHARDED                     SHARD     post-backward, or the end)

On a CPU the post-backward hook waits for its own reduction: REDUCING never outlives the hook (``gradient.py``).
torch (``_common_utils.py``) splits the first into ``TrainingState`` per FSDP instance (IDLE,
FORWARD_BACKWARD, SUMMON_FULL_PARAMS) and ``HandleTrainingState`` per handle (IDLE, FORWARD, BACKWARD_PRE,
BACKWARD_POST, SUMMON_FULL_PARAMS); its handle is IDLE again between forward and backward, where ours says
AWAITING_BACKWARD.  The other two torch reads off tensor sizes: ``FlatParamHandle.needs_unshard`` checks the
full buffer's storage size, ``prepare_gradient_for_backward`` compares ``.grad``'s size with the shard's.
"""
