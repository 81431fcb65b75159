"""Chapter 5: a parameter group, the parameters of one ``fully_shard`` call, gathered and reduced together.

Sharding is per parameter, but communication is per group: one all-gather brings in every parameter
of a block, one reduce-scatter sends out every gradient.  Both need one flat buffer per rank.

All-gather (``unshard``)::

    copy-in (each rank):   [ w.chunk_r | b.chunk_r | ln.chunk_r ]         total = sum of padded chunks
    all-gather:            rank 0's row | rank 1's row | ...              (N, total)
    copy-out (per param):  w_full_padded.view(N, c*rest) <- columns of w, all N rows
                           w_full = w_full_padded[:d0]   (the view the module computes with)

Reduce-scatter (``post_backward``), the mirror image (torch's "chunk-cat")::

    grad of w (d0 rows) -> padded to N*c rows -> N chunks; row r of the input = every grad's chunk r
    input (N, total)  --reduce-scatter, avg-->  this rank's row (total,)  -> split per param,
    [:rows_r] of each -> added to (or set as) the sharded parameter's ``.grad``

State as enums, as torch's: :class:`TrainingState` (IDLE / FORWARD / PRE_BACKWARD / POST_BACKWARD) says
which hook ran last; :class:`~minifsdp.fsdp2.param.ShardedState` (SHARDED / UNSHARDED / SHARDED_POST_FORWARD)
says where the data is.  Implicit backward prefetch (as torch's): a group's pre-backward also all-gathers the group
whose forward ended just before its own, so that gather is issued before this group's reduce-scatter.

An int ``reshard_after_forward=k`` (torch's): after forward each rank keeps 1/k of the full buffers
(state SHARDED_POST_FORWARD) and backward's all-gather runs in a group of k ranks; after backward, 1/N.

HSDP (a 2-D mesh ``(replicate, shard)``): gathers and reduce-scatters run inside the shard group; the
reduced shard is then all-reduced (averaged) over the replicate group, ranks holding the same rows.  With
``set_requires_all_reduce(False)`` the reduced shards add up locally (a partial output) and the all-reduce
waits for the micro-batch that allows it, as torch's.

Gather, then install (torch's ``unshard`` / ``wait_for_unshard``): :meth:`FSDPParamGroup.unshard` only runs the
all-gather and keeps its output; the copy-out into the full parameters and their installation on the modules
happen in :meth:`FSDPParamGroup.wait_for_unshard`, which the group's own pre-forward / pre-backward calls.  A
prefetch (implicit or explicit) runs only the first half.  If the prefetched group never runs (a misprefetch),
the end of backward drops the gathered output and the group stays sharded, so the next step gathers the
updated shards again instead of computing with the old full weights.

``state_dict()`` and ``load_state_dict()`` first reshard the group (pre-hooks on every module holding its
parameters, as torch's), so they always see the sharded DTensors, also right after a forward that kept the
full parameters (``reshard_after_forward=False``).

A group whose parameters define all-gather extension hooks, or mix dtypes, gathers through
:class:`~minifsdp.fsdp2.extensions.GroupGather` instead (several inputs per parameter, one byte buffer).

Note (collectives): ``comm`` is :func:`minifsdp.comm.get_collectives` -- ``"torch"`` (torch.distributed's
``all_gather_single`` / ``reduce_scatter_single``, the ones torch FSDP2 calls, hence bitwise parity) or
``"ring"`` (our hand-written ring over send/recv; sums in another order, so equal only to rounding).
"""

from __future__ import annotations

import functools
from enum import Enum, auto

import torch
import torch.distributed as dist
import torch.nn as nn

from minifsdp.fsdp2.extensions import GroupGather, find_extensions, needs_general_gather
from minifsdp.fsdp2.mixed_precision import MixedPrecisionPolicy, gradient_divide_factors
from minifsdp.fsdp2.nest import map_tensors, tensors_in
from minifsdp.fsdp2.param import FSDPParam, ShardedState, copy_out_group

__all__ = ["TrainingState", "FSDPParamGroup", "CommContext"]


class TrainingState(Enum):
    """Which of the group's hooks ran last in this iteration."""

    IDLE = auto()
    FORWARD = auto()
    PRE_BACKWARD = auto()
    POST_BACKWARD = auto()


class CommContext:
    """Shared by all groups under one root: the order forwards finished in (for backward prefetch)."""

    def __init__(self):
        self.post_forward_order: list[FSDPParamGroup] = []


class _PostBackward(torch.autograd.Function):
    """Identity on the module's inputs; its backward runs once the module's backward is done.

    Written in the functorch style (``setup_context``, a ``jvp``), so that a forward inside ``torch.func.jvp``
    passes the tangents through unchanged."""

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
    """Run a data-moving method outside any functorch transform (``torch.func.jvp``, ``vmap``): its buffers are
    FSDP's own, not tensors of the transformed function, and must keep real storages (as torch FSDP2 does)."""
    @functools.wraps(method)
    def run(*args, **kwargs):
        if torch._C._are_functorch_transforms_active():
            with torch._C._DisableFuncTorch():
                return method(*args, **kwargs)
        return method(*args, **kwargs)
    return run


def _in_backward() -> bool:
    """True inside autograd's backward (a recomputation of checkpointed activations runs forward hooks there)."""
    return torch._C._current_graph_task_id() != -1


class FSDPParamGroup:
    """The parameters of one ``fully_shard`` call and the two collectives that move them."""

    def __init__(self, params: list[nn.Parameter], users: dict[int, list[tuple[nn.Module, str]]],
                 modules: tuple[nn.Module, ...], group, comm, mp_policy: MixedPrecisionPolicy,
                 reshard_after_forward: bool, replicate_group=None, post_forward_group=None, mesh=None,
                 placements: list[tuple] | None = None, offload_to_cpu: bool = False, device=None):
        self.modules = modules
        self.group = group  # the shard group: all-gathers and reduce-scatters run over it
        self.replicate_group = replicate_group  # HSDP: the reduced shards are then averaged over it
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        self.comm = comm
        self.mp_policy = mp_policy
        self.fsdp_params = [
            FSDPParam(p, users[id(p)], group, self.rank, self.world_size, mp_policy.param_dtype,
                      mp_policy.reduce_dtype, mesh, placements[i], offload_to_cpu, device)
            for i, p in enumerate(params)
        ]
        find_extensions(self.fsdp_params)  # parameters whose local tensors gather themselves
        self.reshard_after_forward = reshard_after_forward
        self.post_forward_group = post_forward_group  # int reshard_after_forward: the k ranks to reshard to
        # what the FSDPModule setters change (torch's names and defaults)
        self.reshard_after_backward = True
        self.reduce_grads = True  # set_requires_gradient_sync
        self.all_reduce_grads = True  # set_requires_all_reduce (HSDP)
        self.gradient_divide_factor: float | None = None
        self.force_sum_reduction_for_comms = False
        self.all_reduce_hook = None
        self.unshard_in_backward = True
        self.unshard_async_op = False  # torch's stream choice; the collectives here are synchronous anyway
        self.sharded_state = ShardedState.SHARDED
        self.training_state = TrainingState.IDLE
        self.comm_ctx: CommContext | None = None  # set by the root's lazy init
        self._post_forward_indices: list[int] = []
        self._gathered: tuple[torch.Tensor, list[int]] | None = None  # an all-gather's output not yet copied out
        self._partial_reduce_output: torch.Tensor | None = None  # HSDP shards waiting for their all-reduce
        self._lazy_inited = False
        self.module_fqn = ""  # the modules' names under the root, set at lazy init
        holders = {id(m): m for p in self.fsdp_params for m, _ in p.users}
        for module in holders.values():  # state_dict / load_state_dict see the sharded parameters
            module.register_state_dict_pre_hook(self._reshard_hook)
            module.register_load_state_dict_pre_hook(self._reshard_hook)

    def _reshard_hook(self, *args, **kwargs) -> None:
        self._to_sharded()

    def lazy_init(self) -> None:
        """At the root's first forward: adopt replaced local tensors (meta init, dtype change), refuse meta."""
        if not self._lazy_inited and self.sharded_state is ShardedState.SHARDED:
            for p in self.fsdp_params:
                p.reset_sharded_param()
            find_extensions(self.fsdp_params)  # hooks patched onto the local tensors since count too, as torch's
            self._lazy_inited = True
        on_meta = [p.fqn for p in self.fsdp_params if p.padded_local.is_meta]
        if on_meta:
            raise RuntimeError("FSDP parameters should be materialized from meta device before training, but the "
                               f"following were still on meta device: {on_meta}\nFor example, call "
                               "module.to_empty(device) to materialize to device and call module.reset_parameters() "
                               "on each module to initialize values.")

    # ---------------------------------------------------------------- data movement
    @property
    def is_unsharded(self) -> bool:
        return self.sharded_state is ShardedState.UNSHARDED

    @_outside_functorch
    def unshard(self) -> None:
        """All-gather every parameter of the group (copy-in, one collective); keep the output for
        :meth:`wait_for_unshard`.  A no-op when the group is unsharded or its gather already ran."""
        if self.is_unsharded or self._gathered is not None:
            return
        if not self.unshard_in_backward and self.training_state is TrainingState.PRE_BACKWARD:
            return
        group, world, rank = self.group, self.world_size, self.rank
        if self.sharded_state is ShardedState.SHARDED_POST_FORWARD:  # gather the pieces from k ranks only
            group = self.post_forward_group
            world, rank = dist.get_world_size(group), dist.get_rank(group)
            inputs = [p.piece for p in self.fsdp_params]
        elif needs_general_gather(self.fsdp_params):  # extension hooks or several dtypes: see extensions.py
            self._gathered = GroupGather.start(self.fsdp_params, self.mp_policy, self.comm, group, world, rank)
            return
        else:
            inputs = [p.all_gather_input(cast=False) for p in self.fsdp_params]
        numels = [t.numel() for t in inputs]
        total = sum(numels)
        dtype = self.fsdp_params[0].unsharded_dtype
        gathered = torch.empty(world * total, dtype=dtype, device=inputs[0].device)
        mine = gathered.narrow(0, rank * total, total)
        torch._foreach_copy_(list(mine.split(numels)), inputs)  # copy-in, cast to the compute dtype on the way
        if world > 1:
            self.comm.all_gather(gathered, mine, group=group)
        self._gathered = (gathered.view(world, total), numels)

    @_outside_functorch
    def wait_for_unshard(self) -> None:
        """Copy the gathered rows out into each parameter's full buffer and install the full parameters."""
        if self._gathered is None:
            return
        gathered, self._gathered = self._gathered, None
        if isinstance(gathered, GroupGather):
            gathered.copy_out()
        else:
            rows, numels = gathered
            copy_out_group(self.fsdp_params, rows, numels, flat=self.sharded_state is ShardedState.SHARDED_POST_FORWARD)
        for p in self.fsdp_params:
            p.to_unsharded()
        self.sharded_state = ShardedState.UNSHARDED

    @_outside_functorch
    def reshard(self) -> None:
        """After a forward: reshard as ``reshard_after_forward`` says (not at all, to 1/k, to 1/N); otherwise
        install the sharded parameters again and free the full buffers, as torch's."""
        if self.training_state is TrainingState.FORWARD:
            if not self.reshard_after_forward:
                return
            if self.post_forward_group is not None:
                self._to_sharded_post_forward()
                return
        self._to_sharded()

    def _to_sharded(self) -> None:
        """The sharded parameters on the modules, full buffers freed.  A gather issued by a prefetch and not yet
        copied out stays pending (as torch's): the group's next pre-forward / pre-backward uses it; the end of the
        step's last backward drops it (:meth:`finalize_backward`)."""
        for p in self.fsdp_params:
            p.piece = None
            if self.is_unsharded:
                p.to_sharded()
        self.sharded_state = ShardedState.SHARDED

    def _to_sharded_post_forward(self) -> None:
        """Keep 1/k of each full buffer (k = the post-forward group's size) instead of 1/N."""
        if not self.is_unsharded:
            return
        parts, index = dist.get_world_size(self.post_forward_group), dist.get_rank(self.post_forward_group)
        for p in self.fsdp_params:
            p.keep_piece(parts, index)
        self.sharded_state = ShardedState.SHARDED_POST_FORWARD

    def reduce_scatter_grads(self, params: list[FSDPParam], grads: list[torch.Tensor]) -> None:
        """One reduce-scatter (average over ranks) of the chunk-concatenated full grads; each rank keeps its rows."""
        reduce_dtype = params[0].reduce_dtype or grads[0].dtype
        n = self.world_size
        numels = [p.shard_numel for p in params]
        total = sum(numels)
        if all(p.shard_dim == 0 and g.dim() > 0 and g.dtype == grads[0].dtype for p, g in zip(params, grads)):
            inp = torch.empty(n, total, dtype=reduce_dtype, device=grads[0].device)
            torch._chunk_cat(grads, dim=0, num_chunks=n, out=inp)  # rows cut as ours, zero-padded, cast; one op
        else:
            inp, offset = torch.zeros(n, total, dtype=reduce_dtype, device=grads[0].device), 0
            for p, g, m in zip(params, grads, numels, strict=True):  # the same, one copy per rank and parameter
                for r, piece in enumerate(p.grad_chunks(g)):  # rank r's rows (the last may be short)
                    inp[r, offset: offset + m].view(p.padded_size).narrow(p.shard_dim, 0, piece.shape[p.shard_dim]) \
                        .copy_(piece)
                offset += m
        grads.clear()  # the caller's list too: the full grads are copied in, free them before the reduce-scatter
        replicas = 1 if self.replicate_group is None else dist.get_world_size(self.replicate_group)
        before, after, rs_op, ar_op = gradient_divide_factors(n, replicas, reduce_dtype, self.gradient_divide_factor,
                                                              self.force_sum_reduction_for_comms)
        if before is not None and before != 1:
            inp.div_(before)
        out = torch.empty(total, dtype=reduce_dtype, device=inp.device)
        if n > 1:
            if isinstance(rs_op, tuple):  # ("premul_sum", 1/f): gloo has no PREMUL_SUM; scale, then sum
                inp.mul_(rs_op[1])
                rs_op = "sum"
            self.comm.reduce_scatter(out, inp.view(-1), op=rs_op, group=self.group)
        elif self.gradient_divide_factor is not None:
            out.copy_(inp.view(-1) / self.gradient_divide_factor)
        else:
            out.copy_(inp.view(-1))
        if self.replicate_group is not None:  # HSDP: the same shard on every replica, averaged
            if not self.all_reduce_grads:  # keep adding this micro-batch's shards; all-reduce later
                self._partial_reduce_output = out if self._partial_reduce_output is None \
                    else self._partial_reduce_output + out
                return
            if self._partial_reduce_output is not None:
                out += self._partial_reduce_output
                self._partial_reduce_output = None
            self.comm.all_reduce(out, op=ar_op, group=self.replicate_group)
        if self.all_reduce_hook is not None:
            self.all_reduce_hook(out)
        if after is not None and after != 1:
            out.div_(after)
        offset = 0
        for p, m in zip(params, numels, strict=True):  # split, unpad, back to the original dtype
            local = out[offset: offset + m].view(p.padded_size).narrow(p.shard_dim, 0, p.local_rows)
            p.accumulate_sharded_grad(local.to(p.orig_dtype))
            offset += m

    # ---------------------------------------------------------------- hooks' bodies
    def pre_forward(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        entering = self.training_state is not TrainingState.FORWARD
        self.training_state = TrainingState.FORWARD
        self.unshard()
        self.wait_for_unshard()
        if entering and torch.is_grad_enabled():
            args, kwargs = self._register_post_backward(args, kwargs)
        return args, kwargs

    def post_forward(self) -> None:
        if not _in_backward():
            self.reshard()
            if self.comm_ctx is not None:
                self._post_forward_indices.append(len(self.comm_ctx.post_forward_order))
                self.comm_ctx.post_forward_order.append(self)
        self.training_state = TrainingState.IDLE

    def pre_backward(self, implicit_prefetch: bool = True) -> None:
        if self.training_state is TrainingState.PRE_BACKWARD:
            return
        self.training_state = TrainingState.PRE_BACKWARD
        self.unshard()  # a no-op when the forward kept it, or when a prefetch already gathered it
        self.wait_for_unshard()
        if implicit_prefetch and self._post_forward_indices and self.comm_ctx is not None:
            index = self._post_forward_indices.pop()
            if index > 0:  # implicit prefetch: the group that ran forward just before this one
                self.prefetch(self.comm_ctx.post_forward_order[index - 1], TrainingState.PRE_BACKWARD)

    @staticmethod
    def prefetch(target: "FSDPParamGroup", as_state: TrainingState) -> None:
        """All-gather ``target`` now, as if in ``as_state`` (its own state is restored after)."""
        saved, target.training_state = target.training_state, as_state
        try:
            target.unshard()
        finally:
            target.training_state = saved

    def post_backward(self) -> None:
        """Reduce-scatter this group's gradients (or keep them, when not syncing) and reshard."""
        self.training_state = TrainingState.POST_BACKWARD
        for p in self.fsdp_params:
            p.add_to_accumulated_grad()
        if not self.reduce_grads:
            if self.reshard_after_backward:
                self.reshard()
            for p in self.fsdp_params:
                p.to_accumulated_grad()
            return
        with_grad, grads = [], []
        for p in self.fsdp_params:
            g = p.take_unsharded_grad()
            if g is not None:
                with_grad.append(p)
                grads.append(g)
        if self.reshard_after_backward:
            self.reshard()
        if with_grad:
            self.reduce_scatter_grads(with_grad, grads)

    def finalize_backward(self) -> None:
        """After the last backward of a step: drop a gather no backward used (a misprefetch: the group stays
        sharded) and the forward order."""
        self._gathered = None
        self._post_forward_indices.clear()

    def reset_iter_state(self) -> None:
        """After an exception mid-iteration: forget pending gathers and partial reductions, reshard."""
        self._gathered = None
        self._partial_reduce_output = None
        self._post_forward_indices.clear()
        self.training_state = TrainingState.IDLE
        self._to_sharded()

    def _register_post_backward(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        grads = [t for t in tensors_in((args, kwargs)) if t.requires_grad]
        if not grads:  # e.g. token ids: the root's post-backward runs in the end-of-backward callback
            return args, kwargs
        outs = iter(_PostBackward.apply(self, *grads))
        return map_tensors(lambda t: next(outs) if t.requires_grad else t, (args, kwargs))
