"""A sharding strategy as data (chapter 2.1): ``ShardingPlan.of(strategy)``, its process groups, its divide factors.

The step (``fsdp.py``) never asks "which strategy is this?".  It asks the plan four questions:
is a parameter sharded between uses, is it freed after the forward, after the backward, and
where does its gradient go.  ``print(ShardingPlan.of(ShardingStrategy.HYBRID_SHARD))`` shows the
answers as the table of chapter 2.1; every strategy's answers, side by side:

    strategy             sharded  free after  free after  gradient                      ZeRO
                                  forward     backward
    FULL_SHARD           yes      yes         yes         reduce-scatter                3
    SHARD_GRAD_OP        yes      no          yes         reduce-scatter                2
    NO_SHARD             no       no          no          all-reduce (as DDP)           -
    HYBRID_SHARD         yes      yes         yes         reduce-scatter in the group,  3 in the group
                                                          then all-reduce across groups
    _HYBRID_SHARD_ZERO2  yes      no          yes         as HYBRID_SHARD               2 in the group

("free after forward" never applies to the root: its backward begins at once.)  torch spells the same
answers as sets of strategies (RESHARD_AFTER_FORWARD_HANDLE_STRATEGIES, ...); here each is one row.

HYBRID_SHARD on 4 ranks as a 2 x 2 mesh (replicate dimension first, shard second):

    replicate dim |  rank 0  rank 1    shard groups:     {0, 1}  {2, 3}   (rank 0 and rank 2 hold the same
                  v  rank 2  rank 3    replicate groups: {0, 2}  {1, 3}    shard; ranks 0 and 1 a whole unit)

Note (gradient averaging, bitwise as torch FSDP1): torch does not divide the summed
gradient by N once.  With ``f = predivide_factor(N)`` (the smallest power of two with
``f * f >= N``, stopping early if f stops dividing N) it divides each rank's gradient by
``f`` *before* the sum and the result by ``N / f`` after (``_init_utils.py``,
``_runtime_utils.py``), which keeps fp16 sums from overflowing or underflowing.
N = 2: /2 before; N = 4: /2 before, /2 after; N = 3: /2 before, /1.5 after.  N is the
whole data-parallel size (HYBRID_SHARD: shard x replicate).

What a non-root unit holds of its own parameters through one synced step (1/N: its shard; full: gathered):

                   forward   forward to backward   backward   after its post-backward   all-gathers
    FULL_SHARD     full      1/N                   full       1/N                       2 per step
    SHARD_GRAD_OP  full      full                  full       1/N                       1 per step
    NO_SHARD       full      full                  full       full                      none
    (the root is never freed after its forward: under FULL_SHARD it runs as SHARD_GRAD_OP does)

Note (no_sync): a plan that keeps the parameters from forward to backward also keeps them after the
backward inside ``no_sync()``: it already pays for them, and each next micro-batch's forward then needs no
all-gather (torch's ``_should_free_in_backward`` calls it a heuristic, memory for throughput).  A plan that
frees after the forward was chosen for memory: it frees.
"""

import warnings
from dataclasses import dataclass, replace
from enum import Enum, auto

import torch.distributed as dist


class ShardingStrategy(Enum):  # torch's names (torch/distributed/fsdp/api.py)
    FULL_SHARD = auto()
    SHARD_GRAD_OP = auto()
    NO_SHARD = auto()
    HYBRID_SHARD = auto()
    _HYBRID_SHARD_ZERO2 = auto()

def predivide_factor(world_size: int) -> float:
    """torch FSDP1's gradient pre-divide factor: double f while N % f == 0 and N / f > f.

    torch's is ``DefaultState._get_gradient_predivide_factor`` (``torch/distributed/algorithms/_comm_hooks/
    default_hooks.py``), called by ``_init_utils.py``'s ``_init_process_group_state`` with N."""
    factor = 1  # N = 8: 1 -> 2 -> 4 (8 / 4 = 2, not > 4: stop); N = 6: 1 -> 2 -> 4 (6 % 4 != 0: stop)
    while world_size % factor == 0 and world_size / factor > factor:
        factor *= 2
    return float(factor)

@dataclass(frozen=True)
class ShardingPlan:
    """What a strategy decides, as data.  ``data_parallel_size`` (N) is known once the groups are."""
    strategy: ShardingStrategy
    shards_params: bool  # between uses each rank keeps 1/N of the flat parameter (else the whole of it)
    frees_after_forward: bool  # a non-root unit frees its full parameters when its forward ends
    frees_after_backward: bool  # ... when its backward ends (under no_sync only if it frees after forward too)
    reduce_scatters: bool  # the gradient is reduce-scattered in the shard group (else all-reduced whole)
    all_reduces: bool  # ... all-reduced: NO_SHARD's whole, in the process group; HYBRID's shard, over the replicas
    zero_stage: str  # the ZeRO paper's name for it
    data_parallel_size: int | None = None  # N: every rank that holds a part of the same model

    @staticmethod
    def of(strategy: "ShardingStrategy | None", data_parallel_size: int | None = None) -> "ShardingPlan":
        """The plan of ``strategy`` (None: FULL_SHARD, torch's default), for N ranks if given."""
        plan = _PLANS[ShardingStrategy.FULL_SHARD if strategy is None else strategy]  # a row of the table below
        return replace(plan, data_parallel_size=data_parallel_size)

    @property
    def two_groups(self) -> bool:
        """Sharded inside a group of ranks and replicated across groups (HYBRID): two process groups."""
        return self.reduce_scatters and self.all_reduces

    def on(self, groups) -> "ShardingPlan":
        """This plan for ``groups`` (N known); a shard group of one rank has nothing to shard: NO_SHARD, with a
        warning, as torch's ``_init_core_state`` (``_init_utils.py``).  Why?  It would all-gather and reduce-scatter
        with itself: NO_SHARD's numbers, for more work.  HYBRID keeps its plan: its replicate group still averages
        the gradients (torch switches it too, and its replicas never synchronise: ``minifsdp/fsdp/pitfalls.py``)."""
        plan = replace(self, data_parallel_size=groups.data_parallel_size)
        if groups.shard_size > 1 or not self.shards_params or self.two_groups:
            return plan
        warnings.warn("FSDP on 1 rank: nothing to shard, using NO_SHARD (as torch does)", stacklevel=3)
        return ShardingPlan.of(ShardingStrategy.NO_SHARD, groups.data_parallel_size)

    def divide_factors(self) -> tuple[float, float]:
        """(f, N / f): each rank's gradient is divided by f before the sum, the sum by N / f after."""
        if self.data_parallel_size is None:
            raise ValueError("ShardingPlan.divide_factors needs N: ShardingPlan.of(strategy, data_parallel_size=N)")
        pre = predivide_factor(self.data_parallel_size)  # N = 2: 2; N = 3: 2; N = 4: 2; N = 16: 4
        return pre, self.data_parallel_size / pre

    def __str__(self) -> str:
        reduce = ["reduce-scatter in the shard group"] * self.reduce_scatters
        reduce += [f"all-reduce in the {'replicate' if self.reduce_scatters else 'process'} group"] * self.all_reduces
        yes = {True: "yes", False: "no"}
        rows = [("parameters sharded", yes[self.shards_params]), ("free after forward", yes[self.frees_after_forward]),
                ("free after backward", yes[self.frees_after_backward]), ("gradient", ", then ".join(reduce)),
                ("ZeRO stage", self.zero_stage)]
        if self.data_parallel_size is not None:
            rows.append((f"divide (N = {self.data_parallel_size})", "/{:g} before the sum, /{:g} after".format(
                *self.divide_factors())))
        return "\n".join([f"ShardingPlan {self.strategy.name}"] + [f"  {k:<22}{v}" for k, v in rows])

S = ShardingStrategy
_PLANS = {  # the table of the module docstring, one row each
    S.FULL_SHARD: ShardingPlan(S.FULL_SHARD, True, True, True, True, False, "3"),
    S.SHARD_GRAD_OP: ShardingPlan(S.SHARD_GRAD_OP, True, False, True, True, False, "2"),
    S.NO_SHARD: ShardingPlan(S.NO_SHARD, False, False, False, False, True, "- (as DDP)"),
    S.HYBRID_SHARD: ShardingPlan(S.HYBRID_SHARD, True, True, True, True, True, "3 in the shard group"),
    S._HYBRID_SHARD_ZERO2: ShardingPlan(S._HYBRID_SHARD_ZERO2, True, False, True, True, True,
                                        "2 in the shard group"),
}

@dataclass
class ShardGroups:
    """``shard``: the ranks that split a unit; ``replicate``: ranks holding the same shard (HYBRID) or None."""
    shard: dist.ProcessGroup  # all-gathers and reduce-scatters run here
    replicate: dist.ProcessGroup | None = None  # HYBRID's second all-reduce runs here

    def __post_init__(self):  # this rank's place in the shard group; its size (1/N each); N: shard x replicate
        self.shard_rank, self.shard_size = dist.get_rank(self.shard), dist.get_world_size(self.shard)
        replicas = dist.get_world_size(self.replicate) if self.replicate is not None else 1
        self.data_parallel_size = self.shard_size * replicas

def resolve_groups(plan: ShardingPlan, process_group) -> ShardGroups:
    """``process_group`` (a group, None for all ranks, or HYBRID's ``(shard, replicate)``) -> ShardGroups.

    torch: ``_init_utils.py``'s ``_init_process_group_state``, and for HYBRID
    ``_init_process_group_state_for_hybrid_shard``, which keeps the shard group as ``process_group`` and
    the replicate group as ``_inter_node_pg`` (from a 2-D mesh: dimensions 1 and 0).  Given no
    groups, torch builds them per node from the device count; so does ``minifsdp.FSDP``, the core asks."""
    name, two = plan.strategy.name, isinstance(process_group, tuple)
    if not plan.two_groups and two:
        raise ValueError(f"a (shard_group, replicate_group) tuple is for HYBRID_SHARD, not {name}")
    if not plan.two_groups:
        return ShardGroups(process_group if process_group is not None else dist.group.WORLD)
    if not (two and len(process_group) == 2):
        raise ValueError(f"{name} needs its two groups: device_mesh=init_device_mesh(device, (replicate, "
                         "shard)) or process_group=(shard_group, replicate_group) (see minifsdp.hybrid_groups).")
    groups = ShardGroups(*process_group)  # (shard, replicate): as torch's tuple, and a 2-D mesh's groups
    if groups.data_parallel_size != dist.get_world_size():
        raise ValueError(f"{name}: shard group of {groups.shard_size} x replicate group of "
                         f"{dist.get_world_size(groups.replicate)} ranks = {groups.data_parallel_size}, but the world "
                         f"size is {dist.get_world_size()}; the groups must tile the world (e.g. 4 ranks = 2 x 2).")
    return groups
