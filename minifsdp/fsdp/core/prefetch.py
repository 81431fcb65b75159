"""Prefetching (chapter 2.5): start the next unit's all-gather before it is needed.

    no prefetch     compute:  |b0|      |b1|      |b2|
                    comm:   AG0   AG1     AG2            the compute waits for every all-gather

    prefetch        compute:  |b0|  |b1|  |b2|
                    comm:   AG0 AG1 AG2                  AG(i+1) runs while b(i) computes

"Next" comes from the order recorded while the model runs, as torch FSDP1's
(``_exec_order_utils.py``):

* ``forward_prefetch=True``: the first iteration's *pre-forward* order; in unit i's pre-forward,
  after its own all-gather, start unit i+1's.
* ``backward_prefetch``: this iteration's *post-forward* order, read backwards: ``BACKWARD_PRE`` in
  unit i's pre-backward (two units' parameters alive meanwhile), ``BACKWARD_POST`` after freeing i.
* ``limit_all_gathers=True``: no prefetch while two non-root units' full parameters are alive or
  in flight; that unit then gathers on demand.

Which all-gather starts early in a FULL_SHARD backward, units b2 b1 b0 (the reverse of the forward):

    BACKWARD_PRE    pre b2: AG b2, start AG b1 | grad b2 | post b2: free b2, RS b2
                    pre b1: wait for AG b1, start AG b0 | grad b1 | post b1: free b1, RS b1 | ...
    BACKWARD_POST   pre b2: AG b2 | grad b2 | post b2: free b2, start AG b1, RS b2
                    pre b1: wait for AG b1 | grad b1 | post b1: free b1, start AG b0, RS b1 | ...
    None            every unit's AG in its own pre-backward: the compute waits for each one

BACKWARD_PRE overlaps b1's all-gather with b2's gradient computation, at the price of two units'
parameters at once; BACKWARD_POST frees b2 first (one non-root unit's at a time) and overlaps less.

Note (views): torch's ``FlatParamHandle.unshard`` also points the module's names at views of the full buffer,
so under ``forward_prefetch`` torch makes a unit's views in the pre-forward of the unit before it; ours makes
them in the unit's own pre-forward.  Autograd runs the newest ready node first, so the moment the views are
made decides whether a unit's post-backward reduce-scatter comes before or after the next pre-backward
all-gather: with forward_prefetch, some wrap shapes issue the backward's collectives in another order than
torch's (three are expected failures in ``tests/test_fsdp_regimes_torch.py``; the numbers are bitwise).  Making them
where torch does is not enough alone: a unit then stays gathered longer in the backward, and ours' limit
below, stricter than torch's, would skip prefetches torch issues.

Note (torch's limit): torch limits differently (``_limiter_utils.py``, ``_FreeEventQueue``):
each ``_reshard`` that frees records a device event, and ``_unshard`` (``_runtime_utils.py``), once two
are queued, makes the CPU wait for the oldest before it issues any all-gather.  torch delays the gather;
ours skips only a prefetch, and the unit gathers when it runs.  Both bound the full buffers alive at once.

Note (never changes the numbers): a prefetch only moves *when* an all-gather is issued.  torch FSDP1
issues it on a CUDA stream, so on a CPU it cannot overlap; ours runs on gloo's thread meanwhile.
"""

from enum import Enum, auto

from minifsdp.fsdp.core.state import HandleState, TrainingState

RATE_LIMIT = 2  # at most this many non-root units' full parameters alive or in flight (limit_all_gathers)

class BackwardPrefetch(Enum):
    BACKWARD_PRE = auto()
    BACKWARD_POST = auto()

class ExecutionOrder:
    """The units in the order the model ran them: ``pre_forward`` in the first iteration only (torch: "fix
    the order after the first iteration"), ``post_forward`` every iteration, cleared when it ends.

    torch's ``_ExecOrderData`` (``_exec_order_utils.py``) keeps the same two lists (and each handle's index
    in them); its ``next_iter`` is our ``end_iteration``, called from the final callback."""

    def __init__(self):
        self.pre_forward, self.post_forward, self.first_iteration = [], [], True  # lists of units

    def record_pre_forward(self, unit) -> None:
        if self.first_iteration and unit not in self.pre_forward:  # a unit called twice counts once
            self.pre_forward.append(unit)

    def record_post_forward(self, unit) -> None:
        # every time, as torch's: a unit called twice is here twice, read at its first place (list.index); torch
        # moves the very first unit to its second place (its index 0 is falsy there): the same collectives, tested
        self.post_forward.append(unit)

    def next_in_forward(self, unit):
        """The unit that ran after ``unit`` in the first iteration's forward (None until that order is known)."""
        return None if self.first_iteration else prefetch_target(self.pre_forward, self.post_forward, unit, "forward")

    def next_in_backward(self, unit):
        """The unit whose forward finished just before ``unit``'s: the next one the backward needs."""
        return prefetch_target(self.pre_forward, self.post_forward, unit, "backward")

    def end_iteration(self) -> None:
        if self.pre_forward:  # (a backward without a forward, e.g. only the root ran: keep waiting)
            self.first_iteration = False
        self.post_forward.clear()

def prefetch_target(pre_forward: list, post_forward: list, unit, mode: str):
    """Which unit to prefetch from ``unit`` (exercise 2.5): forward, the one after it in the pre-forward
    order; backward, the one before it in the post-forward order; None at either end or if not recorded."""
    if mode not in ("forward", "backward"):
        raise ValueError(f"mode is 'forward' or 'backward', got {mode!r}")
    order, step = (pre_forward, 1) if mode == "forward" else (post_forward, -1)
    i = order.index(unit) + step if unit in order else -1  # -1 or len(order): past either end, None
    return order[i] if 0 <= i < len(order) else None

def alive_units(units: list) -> int:
    """Non-root units whose full parameters are gathered or on their way (what limit_all_gathers caps)."""
    return sum(1 for u in units[1:] if u._handle is not None and u._handle.sharded
               and u._handle.state is not HandleState.SHARDED)

def can_prefetch(target, units: list, limit_all_gathers: bool, in_backward: bool) -> bool:
    """Whether to start ``target``'s all-gather now (the step issues it): it needs one, its backward is still
    to come, and the limit allows one more (torch's ``_prefetch_handle`` and ``_limiter_utils.py``)."""
    return (target is not None and target._handle is not None
            and target._handle.state is HandleState.SHARDED  # not already there, nor on its way
            and not (in_backward and target.training_state is not TrainingState.AWAITING_BACKWARD)  # (done, or never)
            and not (limit_all_gathers and alive_units(units) >= RATE_LIMIT))
