"""Prefetching (chapter 2.5): start the next unit's all-gather before it is needed.

    no prefetch     compute:  |b0|      |b1|      |b2|
                    comm:   AG0   AG1     AG2            the compute waits for every all-gather

    prefetch        compute:  |b0|  |b1|  |b2|
                    comm:   AG0 AG1 AG2                  AG(i+1) runs while b(i) computes

"Next" comes from the order recorded while the model runs, as torch FSDP1's
(``_exec_order_utils.py``):

* ``forward_prefetch=True``: the first iteration's *pre-forward* order; in unit i's pre-forward,
  after its own all-gather, start unit i+1's and make its views (Note (views)).
* ``backward_prefetch``: this iteration's *post-forward* order, read backwards: ``BACKWARD_PRE`` in
  unit i's pre-backward (two units' parameters alive meanwhile), ``BACKWARD_POST`` after freeing i.
* ``limit_all_gathers=True``: an all-gather first waits for the device's older frees (Note (the limit)).

Which all-gather starts early in a FULL_SHARD backward, units b2 b1 b0 (the reverse of the forward):

    BACKWARD_PRE    pre b2: AG b2, start AG b1 | grad b2 | post b2: free b2, RS b2
                    pre b1: wait for AG b1, start AG b0 | grad b1 | post b1: free b1, RS b1 | ...
    BACKWARD_POST   pre b2: AG b2 | grad b2 | post b2: free b2, start AG b1, RS b2
                    pre b1: wait for AG b1 | grad b1 | post b1: free b1, start AG b0, RS b1 | ...
    None            every unit's AG in its own pre-backward: the compute waits for each one

BACKWARD_PRE overlaps b1's all-gather with b2's gradient computation, at the price of two units'
parameters at once; BACKWARD_POST frees b2 first (one non-root unit's at a time) and overlaps less.

Note (views): torch's ``FlatParamHandle.unshard`` also points the module's names at views of the full
buffer, so a forward prefetch makes the target's views in the pre-forward of the unit before; ours too.
That orders the backward: autograd runs the newest ready node first, and the views' split node (whose
gradient reaches the post-backward hook) is then older than all that b0 computes:

    forward, b0 prefetches b1:   split b1 | b0's ops | relu | b1's ops           (oldest ... newest)
    backward, newest first:      b1's ops | relu | pre-backward b0: AG b0 | ... | split b1: RS b1
    (split b1 made in b1's own forward, after relu: RS b1 would come before AG b0)

So a reduce-scatter may follow the next unit's pre-backward, and three units' parameters may be alive
at once (BACKWARD_PRE: b1's, b0's, and the one b0 prefetches).

Note (the limit): torch's rate limiter (``_limiter_utils._FreeEventQueue``): each ``_reshard`` that frees
records a device event; each ``_unshard``, once two are queued, waits for the oldest before its all-gather:
on a GPU, where the CPU thread only queues kernels, at most two all-gathers run ahead of the device's frees.
It delays, never skips; a CPU's events (``torch.cpu.Event``) record nothing, so on a CPU it never waits.

Note (never changes the numbers): a prefetch only moves *when* an all-gather is issued.  On a CPU torch FSDP1's
gathers synchronously, overlapping nothing; ours (``async_op=True``) runs on gloo's own thread meanwhile.
"""

import collections
from dataclasses import dataclass, field
from enum import Enum, auto

import torch

RATE_LIMIT = 2  # limit_all_gathers: frees queued before an all-gather waits (torch: "empirically chosen")

class BackwardPrefetch(Enum):
    BACKWARD_PRE = auto()
    BACKWARD_POST = auto()

@dataclass(eq=False)
class ExecutionOrder:
    """The units in the order the model ran them: ``pre_forward`` in the first iteration, each unit once (torch:
    "fix the order after the first iteration"), ``post_forward`` every iteration, a unit called twice twice,
    cleared when it ends.  torch's ``_ExecOrderData`` (``_exec_order_utils.py``) keeps these two lists, and each
    handle's first index on the handle (ours: ``list.index``); its ``next_iter`` is our ``end_iteration``."""

    pre_forward: list = field(default_factory=list)  # of units
    post_forward: list = field(default_factory=list)
    started: set = field(default_factory=set)  # the units whose forward began in this iteration
    first_iteration: bool = True

    def record_pre_forward(self, unit) -> None:
        self.started = {unit} if unit.is_root else self.started | {unit}
        if self.first_iteration and unit._handle is not None and unit not in self.pre_forward:  # (called twice: once)
            self.pre_forward.append(unit)

    def record_post_forward(self, unit) -> None:
        # every time, as torch's: a unit called twice is here twice, read at its first place (list.index); torch
        # moves the very first unit to its second place (its index 0 is falsy there): the same collectives, tested
        self.post_forward.append(unit)

    def next_in_forward(self, unit):
        """The unit that ran after ``unit`` in the first iteration's forward (None until that order is known, or
        if its forward began already in this one, as torch's ``_needs_pre_forward_unshard``: a unit called twice)."""
        target = None if self.first_iteration else prefetch_target(self.pre_forward, self.post_forward, unit, "forward")
        return None if target in self.started else target

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

class FreeEvents(collections.deque):
    """torch's ``_FreeEventQueue``: the device events of the latest frees, oldest first (Note (the limit))."""

    def record_free(self, device: torch.device) -> None:
        self.append(torch.get_device_module(device).Event())  # (a CPU's: torch.cpu.Event, which does nothing)
        self[-1].record()

    def wait_before_all_gather(self) -> None:
        if len(self) >= RATE_LIMIT:
            self.popleft().synchronize()
