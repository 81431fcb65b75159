"""Prefetching (chapter 2.5): start the next unit's all-gather before it is needed.

    no prefetch     compute:  |b0|      |b1|      |b2|
                    comm:   AG0   AG1     AG2            the compute waits for every all-gather

    prefetch        compute:  |b0|  |b1|  |b2|
                    comm:   AG0 AG1 AG2                  AG(i+1) runs while b(i) computes

"Next" comes from the order recorded while the model runs, as torch FSDP1's
(``_exec_order_utils.py``):

* ``forward_prefetch=True``: the first iteration's *pre-forward* order; in unit i's
  pre-forward, after its own all-gather, start unit i+1's.
* ``backward_prefetch``: this iteration's *post-forward* order, read backwards:
  ``BACKWARD_PRE`` in unit i's pre-backward hook (two units' parameters alive while i's
  gradient is computed), ``BACKWARD_POST`` in its post-backward hook, after freeing i.
* ``limit_all_gathers=True``: no prefetch while two non-root units' full parameters are
  alive or in flight; that unit then gathers on demand.

Note (never changes the numbers): a prefetch only moves *when* an all-gather is issued.
torch FSDP1 issues it synchronously on a CUDA stream, so on a CPU it cannot overlap; we
issue it with ``async_op=True`` and gloo runs it on its own thread meanwhile.
"""

from enum import Enum, auto

from minifsdp.fsdp.core.state import HandleState, TrainingState

RATE_LIMIT = 2  # at most this many non-root units' full parameters alive or in flight (limit_all_gathers)


class BackwardPrefetch(Enum):
    BACKWARD_PRE = auto()
    BACKWARD_POST = auto()


class ExecutionOrder:
    """The units in the order the model ran them: ``pre_forward`` in the first iteration only (torch: "fix
    the order after the first iteration"), ``post_forward`` every iteration, cleared when it ends."""

    def __init__(self):
        self.pre_forward: list = []
        self.post_forward: list = []
        self.first_iteration = True

    def record_pre_forward(self, unit) -> None:
        if self.first_iteration and unit not in self.pre_forward:
            self.pre_forward.append(unit)

    def record_post_forward(self, unit) -> None:
        if unit not in self.post_forward:
            self.post_forward.append(unit)

    def next_in_forward(self, unit):
        """The unit that ran after ``unit`` in the first iteration's forward (None until that order is known)."""
        if self.first_iteration:
            return None
        return prefetch_target(self.pre_forward, self.post_forward, unit, "forward")

    def next_in_backward(self, unit):
        """The unit whose forward finished just before ``unit``'s: the next one the backward needs."""
        return prefetch_target(self.pre_forward, self.post_forward, unit, "backward")

    def end_iteration(self) -> None:
        if self.pre_forward:
            self.first_iteration = False
        self.post_forward.clear()


def prefetch_target(pre_forward: list, post_forward: list, unit, mode: str):
    """Which unit to prefetch from ``unit`` (exercise 2.5): forward, the one after it in the pre-forward
    order; backward, the one before it in the post-forward order; None at either end or if not recorded."""
    if mode not in ("forward", "backward"):
        raise ValueError(f"mode is 'forward' or 'backward', got {mode!r}")
    order, step = (pre_forward, 1) if mode == "forward" else (post_forward, -1)
    if unit not in order:
        return None
    i = order.index(unit) + step
    return order[i] if 0 <= i < len(order) else None


def alive_units(units: list) -> int:
    """Non-root units whose full parameters are gathered or being gathered (what limit_all_gathers caps);
    ``units`` is the root's list, the root first (its own parameters are not counted, as torch)."""
    return sum(1 for u in units[1:] if u._handle is not None and u._handle.sharded
               and u._handle.state is not HandleState.SHARDED)


def prefetch(target, units: list, limit_all_gathers: bool, in_backward: bool) -> bool:
    """Start ``target``'s all-gather now if it will need one; returns whether one was issued."""
    if target is None or target._handle is None:
        return False
    h = target._handle
    if h.state is not HandleState.SHARDED:
        return False  # already there, or on its way
    if in_backward and target.training_state is not TrainingState.AWAITING_BACKWARD:
        return False  # its backward already ran (or never will)
    if limit_all_gathers and alive_units(units) >= RATE_LIMIT:
        return False
    h.start_unshard(prefetch=True)
    return True
