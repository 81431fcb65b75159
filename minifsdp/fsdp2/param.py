"""Chapter 5: one sharded parameter (FSDP2's ``FSDPParam``), dim-0 rows per rank, labelled as a torch DTensor.

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

* ``sharded_param`` -- what ``named_parameters()``, the optimizer and ``state_dict()`` see between
  iterations, and where ``.grad`` lands: an ``nn.Parameter`` wrapping a torch ``DTensor`` with placement
  ``Shard(0)`` on the device mesh (HSDP: ``(Replicate(), Shard(0))`` on the 2-D mesh), as torch's.  Its
  ``.shape`` is the whole weight's; ``to_local()`` is this rank's rows, a view of the padded storage;
  ``full_tensor()`` gathers the whole.
* ``unsharded_param`` -- a plain ``nn.Parameter`` of the full shape (in ``param_dtype`` under mixed
  precision), a view of a padded buffer of ``N * c`` rows filled by the all-gather's copy-out; installed
  on the module for forward and backward, its storage freed (resized to 0 bytes) when resharded.  It is
  made once, so autograd's saved tensors see the refilled data after a re-gather in backward.

Why a DTensor, when every collective here is ours: the DTensor is the *label* that tells torch's own
functions the tensor is one piece of a whole.  Over plain local tensors, ``torch.nn.utils.clip_grad_norm_``
returns each rank's local norm and clips each rank by a different factor; a ``GradScaler`` checks only this
rank's gradients for an inf; ``state_dict()`` values do not say where their rows sit; and an optimizer
whose multi-tensor (``foreach``) path requires ``type(p)`` to be exactly ``Tensor``, ``Parameter`` or
``DTensor`` falls back to one loop per parameter.  Over DTensors, torch's sharding propagation does the right
thing in each case: the norm's partial sums are all-reduced over the mesh, the scaler's found-inf flag too,
DCP reads each rank's chunk from the placement, and ``foreach`` applies.  Pointwise math on a ``Shard(0)``
DTensor (every optimizer update) runs on the local rows alone, so the numbers are those of plain tensors.
Who moves the data stays ours: the all-gather into one buffer, the copy-out, the reduce-scatter
(:mod:`minifsdp.fsdp2.param_group`); the DTensor never communicates on the training path.

Note (padding): padding rows are zeros in the padded storage, are gathered, and are cut off by the
``[:d0]`` view; gradients for them are reduced and dropped.  They waste ``N * c - d0`` rows per weight.

Note (storage): the optimizer updates the DTensor's local rows in place, which are a view of the padded
storage that the all-gather reads.  Whoever *replaces* the local tensor instead (``module.to_empty``,
``load_state_dict(assign=True)``, ``param.data = ...``) breaks that link; :meth:`FSDPParam.reset_sharded_param`
copies the new rows into the padded storage and re-points the view, as torch's ``reset_sharded_param``.
"""

from __future__ import annotations

import math
from enum import Enum, auto

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Shard

__all__ = ["ShardedState", "FSDPParam", "chunk_rows", "local_row_range", "contiguous_stride"]


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


def contiguous_stride(size: torch.Size) -> tuple[int, ...]:
    """The strides of a contiguous tensor of ``size`` (what a DTensor's global metadata records)."""
    stride, acc = [], 1
    for n in reversed(size):
        stride.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(stride))


def local_of(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local rows (a view), or the tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


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
    ``mesh`` / ``placements``: the DTensor label of the sharded parameter (``(Shard(0),)`` on a 1-D mesh,
    ``(Replicate(), Shard(0))`` on HSDP's 2-D one).  With ``mesh=None`` (one process, no ranks: the exercises'
    reference) the sharded parameter is a plain ``nn.Parameter`` of the local rows.
    """

    def __init__(self, param: nn.Parameter, users: list[tuple[nn.Module, str]], group, rank: int,
                 world_size: int, param_dtype: torch.dtype | None, reduce_dtype: torch.dtype | None,
                 mesh=None, placements: tuple = (Shard(0),)):
        if param.dim() == 0:
            raise ValueError("fully_shard: 0-dim parameters cannot be sharded by rows; view them as (1,)")
        if isinstance(param, DTensor):
            raise NotImplementedError("fully_shard: the parameter is already a DTensor (torch's tensor parallel); "
                                      "minifsdp.parallel's tensor parallel gives plain tensors that fully_shard takes")
        if not param.is_contiguous():
            raise NotImplementedError(f"FSDP does not support non-contiguous parameters yet: {tuple(param.shape)} "
                                      f"with strides {param.stride()}; pass param.contiguous() instead")
        self.users = users
        self.group, self.rank, self.world_size = group, rank, world_size
        self.mesh, self.placements = mesh, tuple(placements)
        self.full_size = param.shape
        self.orig_dtype = param.dtype
        self.init_dtypes(param_dtype, reduce_dtype)
        d0, rest = param.shape[0], tuple(param.shape[1:])
        self.padded_rows = chunk_rows(d0, world_size)
        start, end = local_row_range(d0, world_size, rank)
        self.local_rows = end - start
        self.padded_local = param.new_zeros((self.padded_rows, *rest))  # padded storage, orig dtype
        self.padded_local[: self.local_rows].copy_(param.detach()[start:end])
        self.sharded_param = nn.Parameter(self.to_sharded_dtensor(self.padded_local[: self.local_rows]),
                                          requires_grad=param.requires_grad)
        self.full_padded: torch.Tensor | None = None  # (N * c * prod(rest),) in param_dtype, lazily made
        self.unsharded_param: nn.Parameter | None = None
        self.accumulated_grad: torch.Tensor | None = None  # in reduce_dtype, while grads are not synced
        self.piece: torch.Tensor | None = None  # SHARDED_POST_FORWARD: 1/k of the full buffer, param_dtype
        self.to_sharded()

    def init_dtypes(self, param_dtype: torch.dtype | None, reduce_dtype: torch.dtype | None) -> None:
        """Mixed precision clamped as torch's: no cast when it would change nothing."""
        self.param_dtype = None if param_dtype in (None, self.orig_dtype) or not self.orig_dtype.is_floating_point \
            else param_dtype
        self.reduce_dtype = None if reduce_dtype == (self.param_dtype or self.orig_dtype) else reduce_dtype

    def to_sharded_dtensor(self, local: torch.Tensor) -> torch.Tensor:
        """This rank's rows (a parameter's or a gradient's) labelled with the mesh and placement: no copy,
        no communication (``DTensor.from_local`` with the global shape given, so no check runs)."""
        if self.mesh is None:
            return local
        return DTensor.from_local(local, self.mesh, self.placements, run_check=False, shape=self.full_size,
                                  stride=contiguous_stride(self.full_size))

    @property
    def local_tensor(self) -> torch.Tensor:
        """The sharded parameter's local rows (a view of :attr:`padded_local` unless replaced by a user)."""
        return local_of(self.sharded_param.detach())

    @property
    def shard_numel(self) -> int:
        """Elements in one rank's padded chunk: this parameter's share of the all-gather input."""
        return self.padded_local.numel()

    @property
    def unsharded_dtype(self) -> torch.dtype:
        return self.param_dtype or self.orig_dtype

    def reset_sharded_param(self) -> None:
        """Re-link the sharded parameter to the padded storage after someone replaced its local tensor
        (``to_empty``, ``param.data = ...``, ``load_state_dict(assign=True)``, ``model.to(dtype)``): take the
        parameter the module holds now, copy its rows into a padded storage of its dtype and device, and make
        its local tensor a view of that storage again.  A no-op when nothing was replaced."""
        module, name = self.users[0]
        current = module._parameters.get(name)
        if current is None or current is self.unsharded_param:
            return
        local = local_of(current.detach())
        if local.data_ptr() == self.padded_local.data_ptr() and local.dtype == self.padded_local.dtype \
                and local.device == self.padded_local.device and current is self.sharded_param:
            return
        if tuple(local.shape) != (self.local_rows, *self.full_size[1:]):
            raise RuntimeError(f"fully_shard: {name} now holds a local tensor of shape {tuple(local.shape)}, "
                               f"not this rank's rows {(self.local_rows, *self.full_size[1:])}")
        padded = local.new_zeros((self.padded_rows, *self.full_size[1:]))
        padded[: self.local_rows].copy_(local)
        self.padded_local = padded
        self.orig_dtype = padded.dtype
        requires_grad = current.requires_grad
        self.sharded_param = nn.Parameter(self.to_sharded_dtensor(padded[: self.local_rows]), requires_grad)
        self.full_padded, self.unsharded_param = None, None  # re-made in the new dtype / device on next gather
        self._install(self.sharded_param)

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
        if self.unsharded_param.requires_grad != self.sharded_param.requires_grad:  # frozen or unfrozen since
            self.unsharded_param.requires_grad_(self.sharded_param.requires_grad)
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
        """``new_grad``: this rank's reduced rows (unpadded, orig dtype); set ``.grad`` (a DTensor of them) or
        add them to the rows of the one already there (accumulation across optimizer-free iterations)."""
        grad = self.sharded_param.grad
        if grad is None:
            self.sharded_param.grad = self.to_sharded_dtensor(new_grad)
        else:
            local_of(grad).add_(new_grad)
