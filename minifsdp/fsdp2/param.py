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

Another dim (``shard_placement_fn`` returning ``Shard(d)``, as torch's): every rank holds chunk r of ``torch.chunk``
along dim d, copied into a contiguous tensor; torch requires d's size to divide evenly, so nothing is padded.  The
all-gather still moves flat per-rank chunks; the copy-out concatenates them along d, and the reduce-scatter's
input row r is the gradient's chunk r along d.

Note (padding): padding rows are zeros in the padded storage, are gathered, and are cut off by the
``[:d0]`` view; gradients for them are reduced and dropped.  They waste ``N * c - d0`` rows per weight.

Note (storage): the optimizer updates the DTensor's local rows in place, which are a view of the padded
storage that the all-gather reads.  Whoever *replaces* the local tensor instead (``module.to_empty`` after a
meta-device init, ``model.to(torch.float64)``) breaks that link; at the root's first forward
:meth:`FSDPParam.reset_sharded_param` adopts the new rows (padding them again if needed) and swaps them into the
same parameter object (``torch.utils.swap_tensors``), so an optimizer made before still holds it, as torch's.

Note (CPU offload): with ``CPUOffloadPolicy`` the padded storage, the sharded parameter and its gradient live on
the CPU; the all-gather input is copied to the compute device and each reduced gradient back.  On a CPU-only
machine both are the CPU, and the policy changes nothing.
"""

from __future__ import annotations

import contextlib
import itertools
import math
from enum import Enum, auto

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

__all__ = ["ShardedState", "FSDPParam", "chunk_rows", "local_row_range", "contiguous_stride", "local_of"]


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
    """One original parameter, sharded by rows (or along ``shard_dim``): its padded local storage, its full
    buffer, its users.

    ``users`` is every ``(module, attribute name)`` that holds the parameter (two for a tied weight);
    switching between sharded and unsharded re-registers the right parameter on each of them.
    ``mesh`` / ``placements``: the DTensor label of the sharded parameter (``(Shard(d),)`` on a 1-D mesh,
    ``(Replicate(), Shard(d))`` on HSDP's 2-D one).  With ``mesh=None`` (one process, no ranks: the exercises'
    reference) the sharded parameter is a plain ``nn.Parameter`` of the local rows.
    """

    def __init__(self, param: nn.Parameter, users: list[tuple[nn.Module, str]], group, rank: int,
                 world_size: int, param_dtype: torch.dtype | None, reduce_dtype: torch.dtype | None,
                 mesh=None, placements: tuple = (Shard(0),), offload_to_cpu: bool = False,
                 device: torch.device | None = None):
        if param.dim() == 0:
            raise ValueError("fully_shard: 0-dim parameters cannot be sharded by rows; view them as (1,)")
        if isinstance(param, DTensor):
            raise NotImplementedError("fully_shard: the parameter is already a DTensor (torch's tensor parallel); "
                                      "minifsdp.parallel's tensor parallel gives plain tensors that fully_shard takes")
        if not param.is_contiguous():
            raise NotImplementedError(f"FSDP does not support non-contiguous parameters yet: {tuple(param.shape)} "
                                      f"with strides {param.stride()}; pass param.contiguous() instead")
        self.users = users
        self.fqn = users[0][1] if users else ""  # the full name under the root, set at lazy init
        # who the original parameter was, for refusing one weight sharded by two calls (a tag kept alive here, so
        # unlike id(param) it is never reused by a later object)
        self.orig_uid = param.__dict__.setdefault("_fsdp_orig_uid", object())
        self.group, self.rank, self.world_size = group, rank, world_size
        self.mesh, self.placements = mesh, tuple(placements)
        self.shard_dim = placements[-1].dim if placements else 0
        self.offload_to_cpu = offload_to_cpu
        self.device = device or param.device  # where the all-gather and the compute run
        self.full_size = param.shape
        self.orig_dtype = param.dtype
        self._mp = (param_dtype, reduce_dtype)
        self.init_dtypes(param_dtype, reduce_dtype)
        d, size = self.shard_dim, param.shape[self.shard_dim]
        if d != 0 and size % world_size != 0:
            raise NotImplementedError(f"FSDP does not support uneven sharding on dim {d}: {tuple(param.shape)} "
                                      f"(world size: {world_size})")
        self.padded_rows = chunk_rows(size, world_size)  # along the shard dim
        start, end = local_row_range(size, world_size, rank)
        self.local_rows = end - start
        self.padded_size = param.shape[:d] + (self.padded_rows,) + param.shape[d + 1:]
        padded = param.new_zeros(self.padded_size)
        padded.narrow(d, 0, self.local_rows).copy_(param.detach().narrow(d, start, self.local_rows))
        if offload_to_cpu and not padded.is_meta:  # a meta parameter moves at its materialization
            padded = padded.cpu()
        self.padded_local = padded
        self.sharded_param = nn.Parameter(self.to_sharded_dtensor(padded.narrow(d, 0, self.local_rows)),
                                          requires_grad=param.requires_grad)
        self.full_padded: torch.Tensor | None = None  # (N * padded numel,) in param_dtype, lazily made
        self.unsharded_param: nn.Parameter | None = None
        self.accumulated_grad: torch.Tensor | None = None  # in reduce_dtype, while grads are not synced
        self.piece: torch.Tensor | None = None  # SHARDED_POST_FORWARD: 1/k of the full buffer, param_dtype
        self.extension = None  # all-gather extension hooks on the local tensor: see minifsdp.fsdp2.extensions
        self.to_sharded()

    def init_dtypes(self, param_dtype: torch.dtype | None, reduce_dtype: torch.dtype | None) -> None:
        """Mixed precision clamped as torch's: no cast when it would change nothing."""
        self.param_dtype = None if param_dtype in (None, self.orig_dtype) or not self.orig_dtype.is_floating_point \
            else param_dtype
        self.reduce_dtype = None if reduce_dtype == (self.param_dtype or self.orig_dtype) else reduce_dtype

    def to_sharded_dtensor(self, local: torch.Tensor) -> torch.Tensor:
        """This rank's rows (a parameter's or a gradient's) labelled with the mesh and placement: no copy, no
        communication, and no autograd node (``DTensor.from_local`` would add one, and its checks, every step)."""
        if self.mesh is None:
            return local
        meta = TensorMeta(self.full_size, contiguous_stride(self.full_size), local.dtype)
        return DTensor(local, DTensorSpec(self.mesh, tuple(self.placements), meta), requires_grad=local.requires_grad)

    @property
    def local_tensor(self) -> torch.Tensor:
        """The sharded parameter's local rows (a view of :attr:`padded_local`)."""
        return local_of(self.sharded_param.detach())

    @property
    def local_size(self) -> torch.Size:
        return self.padded_size[:self.shard_dim] + (self.local_rows,) + self.padded_size[self.shard_dim + 1:]

    @property
    def shard_numel(self) -> int:
        """Elements in one rank's padded chunk: this parameter's share of the all-gather input."""
        return self.padded_local.numel()

    @property
    def unsharded_dtype(self) -> torch.dtype:
        return self.param_dtype or self.orig_dtype

    def reset_sharded_param(self) -> None:
        """At lazy init: adopt a local tensor someone put in place of ours (``to_empty``, ``model.to(dtype)``):
        pad it again if needed, make it the storage the all-gather reads, and keep the same parameter object
        (its contents swapped) so optimizers made before still hold it.  A no-op when nothing was replaced."""
        module, name = self.users[0]
        current = module._parameters.get(name)
        if current is None or current is self.unsharded_param:
            return
        self.sharded_param = current
        # the raw local tensor, as torch's reset_sharded_param reads it: to_local() is an autograd op, and a first
        # forward inside a functorch transform (torch.func.jvp) would hand back a wrapper with no storage
        local = current._local_tensor if isinstance(current, DTensor) else current.data
        plain = type(local) is torch.Tensor and type(self.padded_local) is torch.Tensor  # a subclass has no storage
        if local.is_meta or (plain and local.untyped_storage().data_ptr() != 0 and
                             local.untyped_storage().data_ptr() == self.padded_local.untyped_storage().data_ptr()):
            return
        d = self.shard_dim
        if tuple(local.shape) == tuple(self.padded_size):
            padded = local  # nothing to pad: the new local tensor is the storage
        else:
            if tuple(local.shape) != tuple(self.local_size):
                raise RuntimeError(f"fully_shard: {name} now holds local rows of shape {tuple(local.shape)}, not "
                                   f"this rank's {tuple(self.local_size)}")
            padded = local.new_zeros(self.padded_size)
            padded.narrow(d, 0, self.local_rows).copy_(local)
            fresh = nn.Parameter(self.to_sharded_dtensor(padded.narrow(d, 0, self.local_rows)), current.requires_grad)
            torch.utils.swap_tensors(current, fresh)
        self.padded_local = padded
        self.orig_dtype = padded.dtype
        self.init_dtypes(*self._mp)
        self.full_padded, self.unsharded_param = None, None  # re-made in the new dtype / device at the next gather
        self.extension = None  # found again by the group's lazy init
        self._install(self.sharded_param)

    def all_gather_input(self, cast: bool = True) -> torch.Tensor:
        """This rank's padded chunk, flat, in the dtype the forward computes in (``cast=False``: in its own; the
        group's copy-in casts on the way), on the compute device."""
        flat = self.padded_local.view(-1)
        if self.offload_to_cpu:
            flat = flat.to(self.device)
        return flat if self.param_dtype is None or not cast else flat.to(self.param_dtype)

    def alloc_unsharded(self) -> torch.Tensor:
        """The full padded buffer with storage (made on first use, re-allocated after a free)."""
        if self.full_padded is None:
            self.full_padded = torch.empty(self.world_size * self.shard_numel, dtype=self.unsharded_dtype,
                                           device=self.device)
            if self.shard_dim == 0:
                rest = tuple(self.full_size[1:])
                full = self.full_padded.view(self.world_size * self.padded_rows, *rest)[: self.full_size[0]]
            else:  # even chunks along another dim: the buffer holds the whole tensor in its natural layout
                full = self.full_padded.view(self.full_size)
            self.unsharded_param = nn.Parameter(full, requires_grad=self.sharded_param.requires_grad)
        _alloc(self.full_padded)
        return self.full_padded

    def copy_out(self, gathered: torch.Tensor, offset: int, numel: int | None = None, flat: bool = False) -> None:
        """Copy this parameter's columns ``[offset, offset + numel)`` of every rank's gathered row
        (``gathered``: ``(P, total)``, P ranks) into the full buffer, rank after rank.  ``numel`` is one
        rank's share: ``shard_numel`` (P = N), or a post-forward piece (P = k, ``flat``: pieces of the buffer
        itself, see :meth:`keep_piece`).  Along another dim than 0, the N chunks are concatenated along it."""
        numel = self.shard_numel if numel is None else numel
        parts = gathered.shape[0]
        buf = self.alloc_unsharded()
        columns = gathered[:, offset: offset + numel]
        # The same tensor is refilled every iteration: keep autograd's version check from seeing it.
        with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(buf):
            if self.shard_dim == 0 or flat:
                buf.view(parts, numel).copy_(columns)
            else:
                chunks = columns.reshape(parts, *self.padded_size).unbind(0)
                torch.cat(chunks, dim=self.shard_dim, out=buf.view(self.full_size))
        self.piece = None

    def keep_piece(self, parts: int, index: int) -> None:
        """Reshard to a smaller group (torch's int ``reshard_after_forward=k``): keep piece ``index`` of
        the full padded buffer cut in ``parts`` equal flat pieces (so backward gathers from k ranks, not N),
        then free the full buffer.  The modules get the sharded parameters back meanwhile."""
        if self.extension is not None:
            raise NotImplementedError("fully_shard: an int reshard_after_forward with all-gather extensions")
        self.piece = self.full_padded.view(parts, -1)[index].clone()
        self.to_sharded()

    def free_unsharded(self) -> None:
        if self.full_padded is not None:
            _free(self.full_padded)
        if self.extension is not None:
            self.extension.free()

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

    def grad_chunks(self, grad: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The full gradient cut into the N ranks' pieces (rows; the last ones short or missing for dim 0)."""
        if self.shard_dim == 0:
            return grad.split(self.padded_rows)
        return grad.chunk(self.world_size, dim=self.shard_dim)

    def accumulate_sharded_grad(self, new_grad: torch.Tensor) -> None:
        """``new_grad``: this rank's reduced rows (unpadded, orig dtype); set ``.grad`` (a DTensor of them) or
        add them to the rows of the one already there (accumulation across optimizer-free iterations)."""
        if self.offload_to_cpu:
            new_grad = new_grad.to("cpu")
        grad = self.sharded_param.grad
        if grad is None:
            self.sharded_param.grad = self.to_sharded_dtensor(new_grad)
        else:
            local_of(grad).add_(new_grad)


def copy_out_group(params: list[FSDPParam], gathered: torch.Tensor, numels: list[int], flat: bool = False) -> None:
    """The group's copy-out: each parameter's columns of the gathered rows (``(P, total)``) into its full buffer.
    One fused copy (``split_with_sizes_copy``, as torch's) when every parameter is cut by rows; else one each."""
    if not flat and any(p.shard_dim != 0 for p in params):
        for p, offset, n in zip(params, itertools.accumulate([0, *numels[:-1]]), numels, strict=True):
            p.copy_out(gathered, offset, n)
        return
    outs = [p.alloc_unsharded().view(gathered.shape[0], n) for p, n in zip(params, numels, strict=True)]
    with torch.no_grad(), contextlib.ExitStack() as stack:  # (the buffers are refilled: keep their versions)
        for p in params:
            stack.enter_context(torch.autograd._unsafe_preserve_version_counter(p.full_padded))
            p.piece = None
        torch.split_with_sizes_copy(gathered, numels, dim=1, out=outs)
