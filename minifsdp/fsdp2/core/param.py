"""One sharded parameter (torch's ``FSDPParam``, ``_fsdp_param.py``): its rows on this rank, padded, under a label.

FSDP1 shards a unit's flattened parameters (a shard may cut a weight anywhere); FSDP2 shards *each* parameter on
its own, by rows (``Shard(0)``).  With N ranks and a weight of ``d0`` rows, every rank owns a chunk of
``c = ceil(d0 / N)`` rows, the last chunks shorter or empty (``torch.chunk``'s rule, as DTensor's ``Shard(0)``)::

    weight (5 rows), N = 2, c = 3        rank 0's padded_local      rank 1's padded_local
    row 0 ┐                              [row 0]  ┐                 [row 3]  ┐ local_tensor:
    row 1 ├─ rank 0                      [row 1]  ├ local_tensor    [row 4]  ┘ the rows it owns
    row 2 ┘                              [row 2]  ┘                 [ 0 0 ]  <- padding: never seen
    row 3 ┐                                                                     by the user
    row 4 ┘─ rank 1

Why pad: a collective needs as many elements from every rank, so each rank stores and sends ``c`` rows (zeros
below its real ones); the user and the optimizer see only the real rows, a view of that storage.  Gathered, the N
padded chunks stacked are ``N * c`` rows and the weight is their first ``d0``: the padding costs ``N * c - d0``
rows per weight (here 1), and cutting it off is a view, never a copy.

Two parameters stand for each original weight, and the module holds one at a time (:meth:`FSDPParam.install`):

* ``sharded_param``: between iterations, what ``named_parameters()``, the optimizer and ``state_dict()`` see,
  and where ``.grad`` lands.  A torch ``DTensor`` (placement ``Shard(0)`` on the device mesh) whose local tensor
  is ``local_tensor``: its ``.shape`` is the whole weight's, ``to_local()`` this rank's rows.
* ``unsharded_param``: during forward and backward, a plain ``nn.Parameter`` of the full shape (in the compute
  dtype under mixed precision): a view of ``full_padded``, the ``N * c`` rows the all-gather fills.  Made once
  and refilled each gather, so tensors autograd saved in forward see the data again when backward re-gathers; its
  storage is freed (resized to 0 bytes, the tensor object kept) when the group reshards.

Why a DTensor, when every collective here is ours: the label tells torch's own functions that the tensor is one
piece of a whole.  Over plain local tensors ``torch.nn.utils.clip_grad_norm_`` returns each rank's own norm and
clips each rank by a different factor, a ``GradScaler`` sees only this rank's infs, and ``state_dict()`` values
do not say where their rows sit.  Over DTensors, torch's sharding propagation all-reduces the norm's partial sums
and the scaler's found-inf flag, DCP reads each rank's rows from the placement, and optimizers take their
multi-tensor (``foreach``) path, which requires ``type(p)`` to be exactly ``Tensor``, ``Parameter`` or
``DTensor``.  Pointwise math on a ``Shard(0)`` DTensor (every optimizer update) runs on the local rows alone, so
the numbers are those of plain tensors; the label never communicates on the training path.

Note (storage): the optimizer updates the local rows in place, a view of ``padded_local``, the very storage the
next all-gather reads: nothing is copied back after a step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum, auto

import torch
import torch.nn as nn
from torch._prims_common import make_contiguous_strides_for as contiguous_stride  # what a DTensor's metadata records
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

__all__ = ["MixedPrecisionPolicy", "ShardedState", "FSDPParam", "chunk_rows", "local_row_range",
           "contiguous_stride", "alloc_storage", "free_storage"]


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """torch's (``_fsdp_api.py``).  ``param_dtype``: the gathered parameters', which forward and backward compute in
    (the shards and the optimizer keep theirs); ``reduce_dtype``: the gradients' reduction (None: their own);
    ``output_dtype``: the forward's outputs cast to it; ``cast_forward_inputs``: inputs cast to ``param_dtype``."""

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True


class ShardedState(Enum):
    """Where a group's parameters are: the modules hold the sharded ones (full buffers freed) or the full ones."""

    SHARDED = auto()
    UNSHARDED = auto()


def chunk_rows(d0: int, world_size: int) -> int:
    """Rows per rank's padded chunk: ``ceil(d0 / N)``, at least 1 (so every buffer has a shape)."""
    return max(1, math.ceil(d0 / world_size))


def local_row_range(d0: int, world_size: int, rank: int) -> tuple[int, int]:
    """``[start, end)``: the rows of the weight that ``rank`` owns (empty for the last ranks if ``d0`` is small)."""
    c = chunk_rows(d0, world_size)
    start = min(rank * c, d0)
    return start, min(start + c, d0)


def free_storage(tensor: torch.Tensor) -> None:
    """Give a tensor's bytes back, keep the tensor object (autograd may hold it): resize its storage to 0."""
    if tensor.untyped_storage().size() != 0:
        tensor.untyped_storage().resize_(0)


def alloc_storage(tensor: torch.Tensor) -> None:
    """Give a freed tensor its bytes again (contents undefined until the next copy-out fills them)."""
    nbytes = tensor.numel() * tensor.element_size()
    if tensor.untyped_storage().size() != nbytes:
        tensor.untyped_storage().resize_(nbytes)


class FSDPParam:
    """One original parameter, cut into N padded chunks of rows; this rank keeps chunk ``rank``.

    ``users``: every ``(module, name)`` holding the parameter (two for a tied weight).  ``mesh`` / ``placements``:
    the DTensor label; ``mesh=None`` (one process: the exercises' reference) leaves ``sharded_param`` a plain
    ``nn.Parameter``.  ``device``: where gathers and compute run.  Shapes: ``padded_size`` one rank's padded chunk,
    ``local_size`` its real part, ``full_size`` the weight."""

    def __init__(self, param: nn.Parameter, users: list[tuple[nn.Module, str]], rank: int, world_size: int,
                 mesh=None, placements: tuple = (Shard(0),), mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
                 device: torch.device | None = None):
        if not param.is_contiguous():  # torch's check: the rows of a strided view are not one block of memory
            raise NotImplementedError(f"FSDP does not support non-contiguous parameters yet: {tuple(param.shape)} "
                                      f"with strides {param.stride()}; pass param.contiguous() instead")
        self.users = users
        self.fqn = users[0][1] if users else ""  # the name under the root, set at lazy init
        self.orig_uid = param.__dict__.setdefault("_fsdp_orig_uid", object())  # the original's tag (ids are reused)
        self.rank, self.world_size = rank, world_size
        self.mesh, self.placements = mesh, tuple(placements)
        self.device = device or param.device
        self.full_size, self.orig_dtype = param.shape, param.dtype
        self.mp_policy = mp_policy
        self.init_dtypes()
        c = chunk_rows(param.shape[0], world_size)
        start, end = local_row_range(param.shape[0], world_size, rank)
        self.padded_size = torch.Size((c, *param.shape[1:]))
        self.local_size = torch.Size((end - start, *param.shape[1:]))
        self.padded_local = param.new_zeros(self.padded_size)  # a copy: the original may be freed
        self.padded_local[: end - start].copy_(param.detach()[start:end])
        self.sharded_param = nn.Parameter(self.to_sharded_dtensor(self.local_view(self.padded_local)),
                                          requires_grad=param.requires_grad)
        self.full_padded: torch.Tensor | None = None  # (N * padded numel,) in the compute dtype, made at 1st gather
        self.unsharded_param: nn.Parameter | None = None
        self.install(self.sharded_param)

    def init_dtypes(self) -> None:
        """The policy's dtypes, clamped as torch's ``init_dtype_attrs``: None where the cast would change nothing."""
        param_dtype, reduce_dtype = self.mp_policy.param_dtype, self.mp_policy.reduce_dtype
        self.param_dtype = None if param_dtype in (None, self.orig_dtype) or not self.orig_dtype.is_floating_point \
            else param_dtype
        self.reduce_dtype = None if reduce_dtype == (self.param_dtype or self.orig_dtype) else reduce_dtype

    def to_sharded_dtensor(self, local: torch.Tensor) -> torch.Tensor:
        """Local rows (a parameter's or a gradient's) under the mesh and placement: no copy, no communication, no
        autograd node (``DTensor.from_local`` would add one, and its checks, every step)."""
        if self.mesh is None:
            return local
        meta = TensorMeta(self.full_size, contiguous_stride(self.full_size), local.dtype)
        return DTensor(local, DTensorSpec(self.mesh, self.placements, meta), requires_grad=local.requires_grad)

    def local_view(self, padded: torch.Tensor) -> torch.Tensor:
        """The real part of a padded chunk (``(c, ...)`` -> ``local_size``): a view, padding cut off."""
        return padded.view(self.padded_size)[tuple(slice(0, n) for n in self.local_size)]

    @property
    def local_tensor(self) -> torch.Tensor:
        """The sharded parameter's local rows (a view of :attr:`padded_local`)."""
        return self.local_view(self.padded_local)

    @property
    def shard_numel(self) -> int:
        """Elements in one rank's padded chunk: this parameter's share of the all-gather input."""
        return self.padded_local.numel()

    @property
    def unsharded_dtype(self) -> torch.dtype:
        return self.param_dtype or self.orig_dtype

    # ---------------------------------------------------------------- sharded <-> unsharded
    def all_gather_input(self) -> torch.Tensor:
        """This rank's padded chunk, flat, on the compute device (the group's copy-in casts it to the compute dtype)."""
        flat = self.padded_local.view(-1)
        return flat if flat.device == self.device else flat.to(self.device)

    def alloc_unsharded(self) -> torch.Tensor:
        """``full_padded`` with its bytes (made at the first gather, re-allocated after a free); the full parameter
        is its first ``d0`` rows::

            full_padded.view(N * c, ...):  [rank 0's c rows | rank 1's c rows | ...]
            unsharded_param:                [:d0]  (the padding rows below it never reach the module)
        """
        if self.full_padded is None:
            self.full_padded = torch.empty(self.world_size * self.shard_numel, dtype=self.unsharded_dtype,
                                           device=self.device)
            rows = self.full_padded.view(self.world_size * self.padded_size[0], *self.padded_size[1:])
            self.unsharded_param = nn.Parameter(rows[: self.full_size[0]], self.sharded_param.requires_grad)
        alloc_storage(self.full_padded)
        return self.full_padded

    def install(self, param: nn.Parameter) -> None:
        """Register ``param`` on every module that holds this weight (torch's ``_setattr_on_modules``)."""
        for module, name in self.users:
            module._parameters[name] = param

    def to_sharded(self) -> None:
        self.install(self.sharded_param)
        if self.full_padded is not None:
            free_storage(self.full_padded)

    def to_unsharded(self) -> None:
        if self.unsharded_param.requires_grad != self.sharded_param.requires_grad:  # frozen or unfrozen since
            self.unsharded_param.requires_grad_(self.sharded_param.requires_grad)
        self.install(self.unsharded_param)

    # ---------------------------------------------------------------- gradients
    def take_unsharded_grad(self) -> torch.Tensor | None:
        """The full gradient backward left on the unsharded parameter, taken off it (only the caller holds it)."""
        p = self.unsharded_param
        if p is None or p.grad is None:
            return None
        grad, p.grad = p.grad, None
        return grad

    def accumulate_sharded_grad(self, reduced: torch.Tensor) -> None:
        """``reduced``: this rank's padded chunk of the reduced gradient (flat).  Set ``.grad`` to its real rows,
        in the original dtype, where the shard lives (a DTensor, as the parameter), or add them to the ``.grad``
        already there (accumulation across steps without ``zero_grad``)."""
        grad = self.local_view(reduced).to(self.padded_local.device, self.orig_dtype)
        if self.sharded_param.grad is None:
            self.sharded_param.grad = self.to_sharded_dtensor(grad)
        elif isinstance(self.sharded_param.grad, DTensor):
            self.sharded_param.grad.to_local().add_(grad)
        else:
            self.sharded_param.grad.add_(grad)
