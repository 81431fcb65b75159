"""Chapter 5: one sharded parameter (FSDP2's ``FSDPParam``), dim-0 rows per rank.

FSDP1 flattens a unit's parameters into one flat vector and shards the vector; a rank's shard may
start in the middle of one weight and end in the middle of another.  FSDP2 shards *each* parameter
on its own, by rows (dim 0).  With N ranks and a weight of ``d0`` rows, every rank owns a chunk of
``c = ceil(d0 / N)`` rows, the last chunks shorter or empty (``torch.chunk``'s rule)::

    weight (5 rows), N = 2, c = 3         rank 0 storage        rank 1 storage
    row 0 ┐                               [row 0]               [row 3]
    row 1 ├─ rank 0                       [row 1]               [row 4]
    row 2 ┘                               [row 2]               [ 0 0 ]  <- padding, never seen
    row 3 ┐                                                              by the user
    row 4 ┘─ rank 1

The collectives need equal sizes on every rank, so each rank keeps a *padded* storage of ``c`` rows
(zeros below its real rows); what the user and the optimizer see is the unpadded view of its real rows.

Two parameters per original weight:

* ``sharded_param`` -- a :class:`ShardedParameter`, this rank's rows (shape ``(rows_r, *rest)``); it is
  what ``named_parameters()`` and the optimizer see between iterations, and where ``.grad`` lands.
* ``unsharded_param`` -- an ``nn.Parameter`` of the full shape (in ``param_dtype`` under mixed precision),
  a view of a padded buffer of ``N * c`` rows filled by the all-gather's copy-out; installed on the
  module for forward and backward, its storage freed (resized to 0 bytes) when resharded.  It is made
  once, so autograd's saved tensors see the refilled data after a re-gather in backward.

How ours differs from torch: torch's sharded parameter is a ``DTensor`` (``Shard(0)`` placement on a
device mesh), with the full DTensor algebra behind it.  Ours is a plain ``nn.Parameter`` subclass that
holds the local rows and adds the two DTensor methods a user needs, ``to_local()`` (this rank's rows, a
plain tensor sharing storage) and ``full_tensor()`` (all ranks' rows gathered, a collective).  Math on it
gives plain tensors of the local shape; it carries no placement algebra.  Two consequences a user meets:
``p.shape`` is the local shape (a DTensor's is the global one), and anything that reduces over a parameter
sees only this rank's rows -- ``torch.nn.utils.clip_grad_norm_`` over our parameters computes each rank's
*local* norm (over DTensors it reduces over the mesh), so clip with a global norm: the sum of every rank's
squared local norms, all-reduced.  ``state_dict()`` holds the local rows under the original names.

Note (padding): padding rows are zeros in the padded storage, are gathered, and are cut off by the
``[:d0]`` view; gradients for them are reduced and dropped.  They waste ``N * c - d0`` rows per weight.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum, auto

import torch
import torch.distributed as dist
import torch.nn as nn

__all__ = ["ShardedState", "ShardedParameter", "ShardSpec", "FSDPParam", "chunk_rows", "local_row_range"]


class ShardedState(Enum):
    """Where a parameter group's data lives right now."""

    SHARDED = auto()    # modules hold the sharded parameters; the full buffers are freed
    SHARDED_POST_FORWARD = auto()  # int reshard_after_forward: a 1/k piece of the full buffer kept for backward
    UNSHARDED = auto()  # modules hold the full (unsharded) parameters


def chunk_rows(d0: int, world_size: int) -> int:
    """Rows per rank's padded chunk: ``ceil(d0 / N)`` (at least 1 row, so every buffer has a shape)."""
    return max(1, math.ceil(d0 / world_size))


def local_row_range(d0: int, world_size: int, rank: int) -> tuple[int, int]:
    """``[start, end)`` rows of the full weight that ``rank`` owns (empty for the last ranks if ``d0`` is small)."""
    c = chunk_rows(d0, world_size)
    start = min(rank * c, d0)
    return start, min(start + c, d0)


@dataclass(frozen=True)
class ShardSpec:
    """What a :class:`ShardedParameter` knows about the whole it came from."""

    full_size: torch.Size
    group: object  # the process group it is sharded over
    world_size: int
    rank: int
    padded_rows: int  # c = ceil(d0 / N)


class ShardedParameter(nn.Parameter):
    """This rank's dim-0 rows of a parameter, as an ``nn.Parameter`` (torch's is a ``DTensor``).

    Shape ``(rows_r, *rest)`` with ``rows_r`` this rank's unpadded row count.
    """

    _spec: ShardSpec

    def __new__(cls, data: torch.Tensor, requires_grad: bool = True, spec: ShardSpec | None = None):
        self = torch.Tensor._make_subclass(cls, data, requires_grad)
        self._spec = spec
        return self

    def to_local(self) -> torch.Tensor:
        """This rank's rows, a plain tensor sharing this parameter's storage (as ``DTensor.to_local()``)."""
        return self.detach()

    def full_tensor(self) -> torch.Tensor:
        """The whole parameter, gathered from every rank (a collective: call it on all ranks)."""
        spec = self._spec
        padded = self.new_zeros((spec.padded_rows, *spec.full_size[1:]))
        padded[: self.shape[0]].copy_(self.detach())
        out = self.new_empty((spec.world_size * spec.padded_rows, *spec.full_size[1:]))
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(out, padded, group=spec.group)
        return out[: spec.full_size[0]].clone()

    def __repr__(self) -> str:
        return f"ShardedParameter(local {tuple(self.shape)} of {tuple(self._spec.full_size)}, rank {self._spec.rank})"

    def __deepcopy__(self, memo):  # the copy keeps its spec (the process group is shared, not copied)
        out = ShardedParameter(self.detach().clone(), self.requires_grad, self._spec)
        memo[id(self)] = out
        return out

    def __reduce_ex__(self, proto):  # pickles as a plain Parameter of the local rows (a process group cannot)
        return (nn.Parameter, (self.detach().clone(), self.requires_grad))


def _free(tensor: torch.Tensor) -> None:
    storage = tensor.untyped_storage()
    if storage.size() != 0:
        storage.resize_(0)


def _alloc(tensor: torch.Tensor) -> None:
    storage = tensor.untyped_storage()
    nbytes = tensor.numel() * tensor.element_size()
    if storage.size() != nbytes:
        storage.resize_(nbytes)


class FSDPParam:
    """One original parameter, sharded by rows: its padded local storage, its full buffer, its users.

    ``users`` is every ``(module, attribute name)`` that holds the parameter (two for a tied weight);
    switching between sharded and unsharded re-registers the right parameter on each of them.
    """

    def __init__(self, param: nn.Parameter, users: list[tuple[nn.Module, str]], group, rank: int,
                 world_size: int, param_dtype: torch.dtype | None, reduce_dtype: torch.dtype | None):
        if param.dim() == 0:
            raise ValueError("fully_shard: 0-dim parameters cannot be sharded by rows; view them as (1,)")
        self.users = users
        self.group, self.rank, self.world_size = group, rank, world_size
        self.full_size = param.shape
        self.orig_dtype = param.dtype
        # Mixed precision is clamped as torch's: no cast when it would change nothing.
        self.param_dtype = None if param_dtype in (None, param.dtype) or not param.dtype.is_floating_point \
            else param_dtype
        self.reduce_dtype = None if reduce_dtype == (self.param_dtype or param.dtype) else reduce_dtype
        d0, rest = param.shape[0], tuple(param.shape[1:])
        self.padded_rows = chunk_rows(d0, world_size)
        start, end = local_row_range(d0, world_size, rank)
        self.local_rows = end - start
        self.padded_local = param.new_zeros((self.padded_rows, *rest))  # padded storage, orig dtype
        self.padded_local[: self.local_rows].copy_(param.detach()[start:end])
        spec = ShardSpec(param.shape, group, world_size, rank, self.padded_rows)
        self.sharded_param = ShardedParameter(self.padded_local[: self.local_rows], param.requires_grad, spec)
        self.full_padded: torch.Tensor | None = None  # (N * c * prod(rest),) in param_dtype, lazily made
        self.unsharded_param: nn.Parameter | None = None
        self.accumulated_grad: torch.Tensor | None = None  # in reduce_dtype, while grads are not synced
        self.piece: torch.Tensor | None = None  # SHARDED_POST_FORWARD: 1/k of the full buffer, param_dtype
        self.to_sharded()

    @property
    def shard_numel(self) -> int:
        """Elements in one rank's padded chunk: this parameter's share of the all-gather input."""
        return self.padded_local.numel()

    @property
    def unsharded_dtype(self) -> torch.dtype:
        return self.param_dtype or self.orig_dtype

    def all_gather_input(self) -> torch.Tensor:
        """This rank's padded rows, flat, in the dtype the forward computes in."""
        flat = self.padded_local.view(-1)
        return flat if self.param_dtype is None else flat.to(self.param_dtype)

    def alloc_unsharded(self) -> torch.Tensor:
        """The full padded buffer with storage (made on first use, re-allocated after a free)."""
        if self.full_padded is None:
            rest = tuple(self.full_size[1:])
            self.full_padded = torch.empty(self.world_size * self.shard_numel, dtype=self.unsharded_dtype,
                                           device=self.padded_local.device)
            full = self.full_padded.view(self.world_size * self.padded_rows, *rest)[: self.full_size[0]]
            self.unsharded_param = nn.Parameter(full, requires_grad=self.sharded_param.requires_grad)
        _alloc(self.full_padded)
        return self.full_padded

    def copy_out(self, gathered: torch.Tensor, offset: int, numel: int | None = None) -> None:
        """Copy this parameter's columns ``[offset, offset + numel)`` of every rank's gathered row
        (``gathered``: ``(P, total)``, P ranks) into the full buffer, rank after rank.  ``numel`` is one
        rank's share: ``shard_numel`` (P = N), or a post-forward piece (P = k, see :meth:`keep_piece`)."""
        numel = self.shard_numel if numel is None else numel
        parts = gathered.shape[0]
        buf = self.alloc_unsharded()
        # The same tensor is refilled every iteration: keep autograd's version check from seeing it.
        with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(buf):
            buf.view(parts, numel).copy_(gathered[:, offset: offset + numel])
        self.piece = None

    def keep_piece(self, parts: int, index: int) -> None:
        """Reshard to a smaller group (torch's int ``reshard_after_forward=k``): keep piece ``index`` of
        the full padded buffer cut in ``parts`` equal flat pieces (so backward gathers from k ranks, not N),
        then free the full buffer.  The modules get the sharded parameters back meanwhile."""
        self.piece = self.full_padded.view(parts, -1)[index].clone()
        self.to_sharded()

    def free_unsharded(self) -> None:
        if self.full_padded is not None:
            _free(self.full_padded)

    def _install(self, param: nn.Parameter) -> None:
        for module, name in self.users:
            module._parameters[name] = param

    def to_sharded(self) -> None:
        self._install(self.sharded_param)
        self.free_unsharded()

    def to_unsharded(self) -> None:
        self._install(self.unsharded_param)

    # ---------------------------------------------------------------- gradients
    def take_unsharded_grad(self) -> torch.Tensor | None:
        """The full gradient to reduce (accumulated one first), detached from the unsharded parameter."""
        if self.accumulated_grad is not None:
            grad, self.accumulated_grad = self.accumulated_grad, None
            return grad
        if self.unsharded_param is not None and self.unsharded_param.grad is not None:
            grad, self.unsharded_param.grad = self.unsharded_param.grad, None
            return grad
        return None

    def add_to_accumulated_grad(self) -> None:
        """Every post-backward, first: if an accumulator exists, add this backward's full grad into it."""
        p = self.unsharded_param
        if self.accumulated_grad is not None and p is not None and p.grad is not None:
            self.accumulated_grad += p.grad
            p.grad = None

    def to_accumulated_grad(self) -> None:
        """No sync this backward: move a low-precision full grad into a ``reduce_dtype`` accumulator
        (as torch does, so many micro-batches add in the higher precision).  Without mixed precision
        the grad simply stays on the unsharded parameter and autograd adds the next one to it."""
        p = self.unsharded_param
        if self.reduce_dtype is None or p is None or p.grad is None or p.grad.dtype == self.reduce_dtype:
            return
        self.accumulated_grad, p.grad = p.grad.to(self.reduce_dtype), None

    def accumulate_sharded_grad(self, new_grad: torch.Tensor) -> None:
        """``new_grad``: this rank's reduced rows (unpadded, orig dtype); add to or set ``.grad``."""
        if self.sharded_param.grad is None:
            self.sharded_param.grad = new_grad
        else:
            self.sharded_param.grad += new_grad
