"""A parameter group (torch's ``FSDPParamGroup``, ``_fsdp_param_group.py``): one ``fully_shard`` call's parameters,
gathered and reduced together, and the bodies of the four hooks that move them.

One step of TinyGPT, ``fully_shard`` on each block (b0, b1) and the root, on a CPU: every hook and what it does, in
order, as recorded (``tests/test_step_picture.py``; torch's ``fully_shard`` records the same).  AG x: ``unshard``
(copy-in, all-gather) then ``wait_for_unshard`` (copy-out, install the full parameters); prefetch AG x: only the
all-gather, its copy-out in x's own hook; free x: install the sharded parameters, free the full buffers; RS x: take
the full gradients, reduce-scatter (``foreach_reduce``: this rank's rows become ``.grad``); (...): what runs::

    forward   pre root: AG root | pre b0: AG b0 | (b0) | post b0: free b0 | pre b1: AG b1 | (b1) | post b1: free b1
              post root (the root stays gathered: its backward comes first and would gather it again at once)
    backward  pre root: queue the final callback, prefetch AG b1 | (head) | pre b1: copy-out b1, prefetch AG b0
              (b1) | post b1: free b1, RS b1 | pre b0: copy-out b0 | (b0) | post b0: free b0, RS b0 | (embeddings)
    end       final callback | post root: free root, RS root (its inputs, token ids, need no gradient: no hook)

Every collective here is synchronous (torch's too, on a CPU): a prefetch moves a gather earlier, overlapping nothing.

Why free after forward: between a block's forward and its backward every other block runs; holding all full
parameters would cost the whole model's size, the very memory sharding saves.  The price is a second all-gather
per block in backward.  ``reshard_after_forward=False`` trades it back (memory for one gather less).

Why gather and install are two steps (``unshard``, ``wait_for_unshard``): a *prefetch* runs the gather early, for
the group that runs next; if it never runs (a wrong guess), the end of backward drops the result and the group
stays sharded, so the next step gathers the updated shards instead of computing with stale ones.

State as enums, as torch's: :class:`TrainingState` says which hook ran last, ``ShardedState`` where the data is.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from enum import Enum, auto

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import Shard

from minifsdp.fsdp2.core.collectives import foreach_all_gather, foreach_reduce
from minifsdp.fsdp2.core.nest import grad_tensors, map_grad_tensors
from minifsdp.fsdp2.core.param import FSDPParam, MixedPrecisionPolicy, ShardedState
from minifsdp.fsdp2.core.plugin import Plugin

__all__ = ["TrainingState", "MeshInfo", "FSDPParamGroup"]


class TrainingState(Enum):
    """Which of the group's hooks ran last in this iteration."""

    IDLE = auto()
    FORWARD = auto()
    PRE_BACKWARD = auto()
    POST_BACKWARD = auto()


@dataclass(frozen=True)
class MeshInfo:
    """Where a group lives (torch's ``FSDPMeshInfo``): the group its collectives run over, the DTensor label (mesh,
    placements), how many ranks' gradients are averaged (``None``: the shard group's size)."""

    shard_group: dist.ProcessGroup
    mesh: object = None
    placements: tuple = (Shard(0),)
    data_parallel_size: int | None = None


class _PostBackward(torch.autograd.Function):
    """Identity on a module's inputs whose backward runs the group's post-backward once the module's is done (torch's
    ``RegisterPostBackwardFunction``); functorch-style, so a forward under ``torch.func.jvp`` passes tangents on."""

    generate_vmap_rule = True

    @staticmethod
    def forward(group, *inputs):
        return inputs

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.group = inputs[0]

    @staticmethod
    def backward(ctx, *grads):
        ctx.group.post_backward()
        return (None, *grads)

    @staticmethod
    def jvp(ctx, group_tangent, *tangents):
        return tangents


def _outside_functorch(method):
    """Run a data-moving method outside any functorch transform (``torch.func.jvp``, ``vmap``): FSDP's buffers are
    its own, not tensors of the transformed function, and need real storages (as torch's)."""
    @functools.wraps(method)
    def run(*args, **kwargs):
        if torch._C._are_functorch_transforms_active():
            with torch._C._DisableFuncTorch():
                return method(*args, **kwargs)
        return method(*args, **kwargs)
    return run


class FSDPParamGroup:
    """The parameters of one ``fully_shard`` call and the two collectives that move them."""

    def __init__(self, params: list[nn.Parameter], users: dict[int, list[tuple[nn.Module, str]]],
                 modules: tuple[nn.Module, ...], mesh_info: MeshInfo, mp_policy: MixedPrecisionPolicy,
                 reshard_after_forward: bool, comm, device: torch.device, plugins: list[Plugin] = ()):
        self.modules = modules
        self.group = mesh_info.shard_group
        self.rank, self.world_size = dist.get_rank(self.group), dist.get_world_size(self.group)
        self.data_parallel_size = mesh_info.data_parallel_size or self.world_size
        self.comm, self.mp_policy, self.device = comm, mp_policy, device
        self.plugins = list(plugins)
        self.fsdp_params = [FSDPParam(p, users[id(p)], self.rank, self.world_size, mesh_info.mesh,
                                      mesh_info.placements, mp_policy, device) for p in params]
        # when to free, what to divide by: torch's names and defaults, which the module's setters (above) change
        self.reshard_after_forward = reshard_after_forward
        self.reshard_after_backward = True
        self.unshard_in_backward = True  # False: backward does not need these weights (an embedding's)
        self.gradient_divide_factor: float | None = None  # None: the number of data-parallel ranks
        self.force_sum_reduction_for_comms = False  # True: the collectives only sum; the divides run apart
        self.sharded_state = ShardedState.SHARDED
        self.training_state = TrainingState.IDLE
        self.post_forward_order: list[FSDPParamGroup] | None = None  # the root's: the order forwards ended in
        self.module_fqn = ""  # the modules' names under the root, set at lazy init (messages, records)
        self._post_forward_indices: list[int] = []  # where this group's forwards sit in that order
        self._gathered = None  # an all-gather not yet copied out (an AllGatherResult or a plugin's)
        self._lazy_inited = False
        for plugin in self.plugins:
            plugin.after_shard(self, params)

    def lazy_init(self) -> None:
        """At the root's first forward, once: the plugins' turn (the layer above adopts what changed since)."""
        if not self._lazy_inited and self.sharded_state is ShardedState.SHARDED:
            for plugin in self.plugins:
                plugin.on_lazy_init(self)
            self._lazy_inited = True

    # ---------------------------------------------------------------- data movement
    @property
    def is_unsharded(self) -> bool:
        return self.sharded_state is ShardedState.UNSHARDED

    @_outside_functorch
    def unshard(self) -> None:
        """Copy-in and all-gather every parameter of the group, and keep the result for :meth:`wait_for_unshard`.
        A no-op when the group is unsharded or its gather already ran (a prefetch)."""
        if self.is_unsharded or self._gathered is not None:
            return
        if not self.unshard_in_backward and self.training_state is TrainingState.PRE_BACKWARD:
            return
        for plugin in self.plugins:
            if (gathered := plugin.all_gather(self)) is not None:
                self._gathered = gathered
                return
        inputs = [p.all_gather_input() for p in self.fsdp_params]
        self._gathered = foreach_all_gather(self.fsdp_params, inputs, self.fsdp_params[0].unsharded_dtype,
                                            self.comm, self.group, self.rank, self.world_size)

    @_outside_functorch
    def wait_for_unshard(self) -> None:
        """Copy the gathered rows out into each parameter's full buffer; install the full parameters."""
        if self._gathered is None:
            return
        gathered, self._gathered = self._gathered, None
        gathered.copy_out()
        for p in self.fsdp_params:
            p.to_unsharded()
        self.sharded_state = ShardedState.UNSHARDED

    @_outside_functorch
    def reshard(self) -> None:
        """Install the sharded parameters and free the full buffers; after a forward, only if
        ``reshard_after_forward`` (torch's ``reshard``)."""
        if self.training_state is TrainingState.FORWARD and not self.reshard_after_forward:
            return
        self.to_sharded()

    def to_sharded(self) -> None:
        """The sharded parameters on the modules, the full buffers freed.  A prefetched gather not yet copied
        out stays pending (the group's next hook uses it; the end of the last backward drops it)."""
        for plugin in self.plugins:
            plugin.before_reshard(self)
        if self.is_unsharded:
            for p in self.fsdp_params:
                p.to_sharded()
        self.sharded_state = ShardedState.SHARDED

    # ---------------------------------------------------------------- the hooks' bodies
    def pre_forward(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Gather; and on entering the forward, wrap the inputs so autograd calls :meth:`post_backward` once the
        module's backward is done (the gradients of its inputs are its last product)."""
        entering = self.training_state is not TrainingState.FORWARD
        self.training_state = TrainingState.FORWARD
        self.unshard()
        self.wait_for_unshard()
        if entering and torch.is_grad_enabled():
            grads = grad_tensors((args, kwargs))
            if grads:  # none (token ids): the end-of-backward callback runs this group's post-backward
                outs = iter(_PostBackward.apply(self, *grads))
                args, kwargs = map_grad_tensors(lambda t: next(outs), (args, kwargs))
        return args, kwargs

    def post_forward(self) -> None:
        """Reshard, and record this forward's place in the order (backward runs it in reverse)."""
        if torch._C._current_graph_task_id() == -1:  # not in backward (recomputing checkpointed activations)
            self.reshard()
            if self.post_forward_order is not None:
                self._post_forward_indices.append(len(self.post_forward_order))
                self.post_forward_order.append(self)
        self.training_state = TrainingState.IDLE

    def pre_backward(self, implicit_prefetch: bool = True) -> None:
        """Gather again (a no-op if the forward kept them or a prefetch ran); then prefetch the group whose forward
        ended just before this one's, next in backward: its gather goes before our reduce-scatter."""
        if self.training_state is TrainingState.PRE_BACKWARD:
            return
        self.training_state = TrainingState.PRE_BACKWARD
        self.unshard()
        self.wait_for_unshard()
        if implicit_prefetch and self._post_forward_indices and self.post_forward_order is not None:
            index = self._post_forward_indices.pop()
            if index > 0:
                self.prefetch(self.post_forward_order[index - 1], TrainingState.PRE_BACKWARD)

    @staticmethod
    def prefetch(target: FSDPParamGroup, as_state: TrainingState) -> None:
        """Run ``target``'s all-gather now, as if in ``as_state`` (its own state is restored after)."""
        saved, target.training_state = target.training_state, as_state
        try:
            target.unshard()
        finally:
            target.training_state = saved

    def post_backward(self) -> None:
        """Take the full gradients, reshard, reduce-scatter them."""
        self.training_state = TrainingState.POST_BACKWARD
        with_grad, grads = [], []
        for p in self.fsdp_params:
            if (g := p.take_unsharded_grad()) is not None:  # frozen parameters have none
                with_grad.append(p)
                grads.append(g)
        if self.reshard_after_backward:
            self.reshard()
        foreach_reduce(self, with_grad, grads)

    def finalize_backward(self) -> None:
        """After a step's last backward: drop a gather no backward used (a misprefetch) and the forward order."""
        self._gathered = None
        self._post_forward_indices.clear()
