"""Chapter 4.4: tensor parallelism (Megatron-LM) from scratch: column- and row-parallel Linear layers.

Data parallelism copies the model and splits the batch; tensor parallelism splits each weight matrix and
keeps the batch whole.  Two Linear layers in a row need only one all-reduce in the forward and one in the
backward when the first is split by its output rows and the second by its input columns (Shoeybi et al.,
"Megatron-LM", 2019, section 3).  A 2-rank MLP, ``z = fc2(gelu(fc1(x)))``, fc1: in -> h, fc2: h -> out:

    x (B, in), the same on every rank
    |
    f   forward: identity          backward: all-reduce(dx)   (each rank holds only part of dx)
    |
    +---------------------------+---------------------------+
    | rank 0                    | rank 1                    |
    | fc1  A0 = A[:h/2, :]      | fc1  A1 = A[h/2:, :]      |   ColwiseParallel: weight rows, bias rows
    | y0 = gelu(x A0^T + a0)    | y1 = gelu(x A1^T + a1)    |   (B, h/2): elementwise ops stay local
    | fc2  B0 = B[:, :h/2]      | fc2  B1 = B[:, h/2:]      |   RowwiseParallel: weight columns
    | p0 = y0 B0^T              | p1 = y1 B1^T              |   (B, out): a partial sum
    +---------------------------+---------------------------+
    |
    g   forward: all-reduce(p0 + p1), then + b      backward: identity
    |
    z (B, out), the same on every rank

f and g are conjugate: each is the other's transpose (identity <-> all-reduce), so the forward all-reduces
once (in g) and the backward once (in f).  Attention splits the same way by heads: the fused q/k/v
projection is column-parallel, each rank computes its own heads, the output projection is row-parallel.

    parallelize_module(model, mesh_or_group, {"net.2": ColwiseParallel(), "net.4": RowwiseParallel()})

Note (the parameter IS the local tensor): after :func:`parallelize_module` each sharded ``weight``/``bias``
is a plain ``nn.Parameter`` holding this rank's slice (``weight.shape == (out / N, in)`` for colwise).
torch's ``parallelize_module`` makes it a ``DTensor`` instead: a tensor that knows its mesh and placement
(``Shard(0)``), whose ``.to_local()`` is the slice and whose ``.full_tensor()`` all-gathers it, and whose
every operation dispatches through sharding rules.  Here there is no wrapper: ``param`` is what torch's
``param.to_local()`` returns, any optimizer works on it unchanged, and :func:`full_tensor` gathers it.
The slice's layout is recorded on the parameter (``param.tp_shard``, a :class:`TPShard`).

Note (where the weights come from): every rank slices its own full copy, so every rank must have built the
same model (the project's models are seeded).  torch instead scatters rank 0's copy (``src_data_rank=0``).

Note (bias of a row-parallel layer): it is kept whole on every rank and added once, after the all-reduce
(Megatron's order).  Adding it whole before would count it N times; torch's DTensor adds ``b / N`` on each
rank before the all-reduce, which is the same sum in another order (the tests measure the last-bit difference).

Where we differ from torch on purpose (each is a line to diff):
  * parameters are plain tensors, not DTensors (above); ``full_tensor(p)`` for ``p.full_tensor()``;
  * ``ColwiseParallel(chunks=3)`` cuts a fused q/k/v projection by heads; torch has no such option;
  * no ``input_layouts`` / ``output_layouts`` / ``use_local_output``: colwise takes a whole input and returns
    its local columns, rowwise takes local columns and returns the whole output (torch's defaults);
  * ``nn.Linear`` only (torch also cuts ``nn.Embedding``), and no ``SequenceParallel``.
"""

from __future__ import annotations

import fnmatch
import types
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from minifsdp.comm.collectives import get_collectives

__all__ = ["ParallelStyle", "ColwiseParallel", "RowwiseParallel", "parallelize_module", "full_tensor", "TPShard",
           "copy_to_tensor_parallel", "reduce_from_tensor_parallel"]


# ----------------------------------------------------------------------------- f and g
def _all_reduce(tensor: torch.Tensor, group, collectives: str) -> torch.Tensor:
    """Sum ``tensor`` over ``group`` into a new tensor (the one place this module communicates)."""
    out = tensor.clone(memory_format=torch.contiguous_format)
    get_collectives(collectives).all_reduce(out, group=group)
    return out


class _CopyToTensorParallel(torch.autograd.Function):
    """f: identity in the forward; all-reduce of the input's gradient in the backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group, collectives: str) -> torch.Tensor:
        ctx.group, ctx.collectives = group, collectives
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_reduce(grad, ctx.group, ctx.collectives), None, None


class _ReduceFromTensorParallel(torch.autograd.Function):
    """g: all-reduce in the forward; identity for the gradient in the backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group, collectives: str) -> torch.Tensor:
        return _all_reduce(x, group, collectives)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None, None


def copy_to_tensor_parallel(x: torch.Tensor, group=None, collectives: str = "torch") -> torch.Tensor:
    """f of the module docstring: ``x`` unchanged; its gradient is summed over ``group``."""
    return _CopyToTensorParallel.apply(x, group, collectives)


def reduce_from_tensor_parallel(x: torch.Tensor, group=None, collectives: str = "torch") -> torch.Tensor:
    """g of the module docstring: the sum of ``x`` over ``group``; its gradient passes unchanged."""
    return _ReduceFromTensorParallel.apply(x, group, collectives)


# ----------------------------------------------------------------------------- where a slice lives
@dataclass(frozen=True)
class TPShard:
    """How a parameter was cut: along ``dim``, into ``world`` pieces, inside each of ``chunks`` blocks.

    ``chunks > 1`` is a fused projection (q, k and v stacked): each block is cut separately and this
    rank keeps its piece of every block, stacked in the same order.
    """

    dim: int
    rank: int
    world: int
    chunks: int
    full_shape: tuple[int, ...]
    group: object = None
    collectives: str = "torch"

    def __deepcopy__(self, memo) -> "TPShard":
        return self  # frozen, and a process group cannot be copied: a deep-copied model shares it


def _take(full: torch.Tensor, shard: TPShard) -> torch.Tensor:
    blocks = full.chunk(shard.chunks, dim=shard.dim)
    return torch.cat([b.chunk(shard.world, dim=shard.dim)[shard.rank] for b in blocks], dim=shard.dim)


def _shard_parameter(module: nn.Module, name: str, dim: int, chunks: int, group, collectives: str) -> None:
    full = getattr(module, name)
    shard = TPShard(dim, dist.get_rank(group), dist.get_world_size(group), chunks, tuple(full.shape), group,
                    collectives)
    local = nn.Parameter(_take(full.detach(), shard).clone(), requires_grad=full.requires_grad)
    local.tp_shard = shard
    setattr(module, name, local)
    module._tp_shard = shard  # the hooks read it here: under FSDP1 ``module.weight`` is a plain view without it


def full_tensor(tensor: torch.Tensor, shard: TPShard | None = None) -> torch.Tensor:
    """The whole tensor a slice was cut from (an all-gather), as torch's ``DTensor.full_tensor()``.

    ``shard`` defaults to ``tensor.tp_shard``; a gradient has none, so pass its parameter's:
    ``full_tensor(p.grad, p.tp_shard)``.  A tensor that was not cut is returned detached, unchanged.
    Collective: every rank of the group must call it.
    """
    shard = shard if shard is not None else getattr(tensor, "tp_shard", None)
    if shard is None:
        return tensor.detach()
    pieces = [torch.empty_like(tensor) for _ in range(shard.world)]
    dist.all_gather(pieces, tensor.detach().contiguous(), group=shard.group)
    per_rank = [p.chunk(shard.chunks, dim=shard.dim) for p in pieces]
    blocks = [torch.cat([per_rank[r][c] for r in range(shard.world)], dim=shard.dim) for c in range(shard.chunks)]
    return torch.cat(blocks, dim=shard.dim)


# ----------------------------------------------------------------------------- the two styles
class ParallelStyle:
    """What to do to one submodule (torch's ``ParallelStyle``): cut its parameters and wrap its forward."""

    def _validate(self, module: nn.Module, fqn: str, group) -> None:
        raise NotImplementedError

    def _apply(self, module: nn.Module, fqn: str, group, collectives: str = "torch") -> nn.Module:
        raise NotImplementedError

    @staticmethod
    def _check(module: nn.Module, fqn: str, style: str, attr: str, parts: int, group) -> None:
        if not isinstance(module, nn.Linear):
            raise TypeError(f"{style} on {fqn!r}: only nn.Linear is supported here, got {type(module).__name__}")
        width = getattr(module, attr)
        world = dist.get_world_size(group)
        if width % parts or (width // parts) % world:
            fused = f" in {parts} fused blocks of {width // parts}" if parts > 1 else ""
            raise ValueError(
                f"{style} on {fqn!r}: {attr}={width}{fused} is not divisible by the tensor-parallel group size "
                f"{world}; each rank must hold an equal slice (choose a width that is a multiple of {world * parts})."
            )


def _colwise_pre_hook(module: nn.Linear, args: tuple) -> tuple:
    """Before a column-parallel Linear: its input goes through f (the gradient's all-reduce)."""
    shard = module._tp_shard
    return (copy_to_tensor_parallel(args[0], shard.group, shard.collectives), *args[1:])


class ColwiseParallel(ParallelStyle):
    """Cut a Linear's weight by output rows (``Shard(0)``) and its bias alike; the input stays whole.

    Forward: ``y_r = f(x) @ W_r^T + b_r``, shape ``(..., out / N)``: this rank's columns of the output, as a
    plain tensor (torch's default ``use_local_output=True``).  The backward all-reduces the input's gradient.

    ``chunks``: the weight is ``chunks`` projections stacked by rows (a fused ``qkv`` is 3); each is cut
    separately so rank r holds ``[q_r; k_r; v_r]`` and ``y_r.chunk(3, -1)`` gives its own heads' q, k, v.
    torch's ``ColwiseParallel`` has no such option: it cuts the fused weight contiguously, so on 2 ranks
    rank 0 holds all of q and half of k (the tests show that output differs from the unsharded model).
    """

    def __init__(self, *, chunks: int = 1):
        if not isinstance(chunks, int) or chunks < 1:
            raise ValueError(f"chunks must be a positive int, got {chunks!r}")
        self.chunks = chunks

    def _validate(self, module: nn.Module, fqn: str, group) -> None:
        self._check(module, fqn, "ColwiseParallel", "out_features", self.chunks, group)

    def _apply(self, module: nn.Module, fqn: str, group, collectives: str = "torch") -> nn.Module:
        self._validate(module, fqn, group)
        _shard_parameter(module, "weight", 0, self.chunks, group, collectives)
        if module.bias is not None:
            _shard_parameter(module, "bias", 0, self.chunks, group, collectives)
        module.register_forward_pre_hook(_colwise_pre_hook)
        return module

    def __repr__(self) -> str:
        return f"ColwiseParallel(chunks={self.chunks})" if self.chunks > 1 else "ColwiseParallel()"


def _rowwise_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """The forward of a row-parallel Linear: partial product, all-reduce (g), then the whole bias once."""
    shard = self._tp_shard
    out = reduce_from_tensor_parallel(F.linear(x, self.weight), shard.group, shard.collectives)
    return out if self.bias is None else out + self.bias


class RowwiseParallel(ParallelStyle):
    """Cut a Linear's weight by input columns (``Shard(1)``); the bias stays whole (``Replicate()``).

    Input: this rank's columns ``(..., in / N)`` (a column-parallel layer's output).  Forward:
    ``z = g(x_r @ W_r^T) + b``, shape ``(..., out)``, the same on every rank (one all-reduce).
    """

    def _validate(self, module: nn.Module, fqn: str, group) -> None:
        self._check(module, fqn, "RowwiseParallel", "in_features", 1, group)

    def _apply(self, module: nn.Module, fqn: str, group, collectives: str = "torch") -> nn.Module:
        self._validate(module, fqn, group)
        _shard_parameter(module, "weight", 1, 1, group, collectives)
        module.forward = types.MethodType(_rowwise_forward, module)  # found before the class's forward
        return module

    def __repr__(self) -> str:
        return "RowwiseParallel()"


# ----------------------------------------------------------------------------- the plan
def _group_of(device_mesh_or_group):
    """A ProcessGroup from a 1-D DeviceMesh, a ProcessGroup, or None (the default group)."""
    if device_mesh_or_group is None:
        return dist.group.WORLD
    if hasattr(device_mesh_or_group, "get_group"):  # torch.distributed.device_mesh.DeviceMesh
        if device_mesh_or_group.ndim != 1:
            raise ValueError(
                f"tensor parallelism needs a 1-D mesh, got {device_mesh_or_group.ndim}-D "
                f"{tuple(device_mesh_or_group.shape)}; pass its tensor-parallel dimension, e.g. mesh['tp']."
            )
        return device_mesh_or_group.get_group()
    return device_mesh_or_group


def _matching(module: nn.Module, pattern: str) -> list[tuple[str, nn.Module]]:
    """Submodules whose dotted name matches ``pattern`` atom by atom (``*`` wildcards, as torch's plans)."""
    atoms = pattern.split(".")
    return [(n, m) for n, m in module.named_modules() if n and len(n.split(".")) == len(atoms)
            and all(fnmatch.fnmatchcase(a, p) for a, p in zip(n.split("."), atoms))]


def parallelize_module(module: nn.Module, device_mesh_or_group=None,
                       parallelize_plan: ParallelStyle | dict[str, ParallelStyle] | None = None, *,
                       collectives: str = "torch") -> nn.Module:
    """Apply a tensor-parallel plan in place and return ``module`` (torch's ``parallelize_module``).

    Args:
        module: the model, the same numbers on every rank of the group.
        device_mesh_or_group: a 1-D ``DeviceMesh`` (torch's argument), a ``ProcessGroup``, or None (the
            default group).
        parallelize_plan: a style for ``module`` itself, or ``{submodule name: style}``; names may hold
            ``*`` per dotted atom (``"blocks.*.mlp.0"``).
        collectives: "torch" (``dist.all_reduce``) or "ring" (our ring all-reduce from
            ``minifsdp.comm``, whose bytes ``minifsdp.comm.count_bytes()`` counts).  Not in torch's signature.

    Raises:
        ValueError: a plan key names no submodule, or a width is not divisible by the group size.
        TypeError: a style is put on something other than an ``nn.Linear``.
    """
    group = _group_of(device_mesh_or_group)
    get_collectives(collectives)  # a bad name fails here, not in the first forward
    if parallelize_plan is None:
        raise ValueError("parallelize_module needs a plan: a ParallelStyle or {submodule name: ParallelStyle}")
    if isinstance(parallelize_plan, ParallelStyle):
        return parallelize_plan._apply(module, type(module).__name__, group, collectives)
    targets = []
    for key, style in parallelize_plan.items():
        if not isinstance(style, ParallelStyle):
            raise TypeError(f"plan[{key!r}] must be ColwiseParallel() or RowwiseParallel(), got {style!r}")
        found = _matching(module, key)
        if not found:
            names = [n for n, _ in module.named_modules() if n]
            raise ValueError(f"plan key {key!r} names no submodule of {type(module).__name__}; "
                             f"its submodules are {names[:12]}{' ...' if len(names) > 12 else ''}")
        targets += [(name, sub, style) for name, sub in found]
    for name, sub, style in targets:  # check every target before changing any
        style._validate(sub, name, group)
    for name, sub, style in targets:
        style._apply(sub, name, group, collectives)
    return module
