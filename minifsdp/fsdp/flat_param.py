"""Flat parameters (chapter 2.1): many parameters -> one 1-D buffer -> N equal shards.

FSDP does not shard parameter by parameter.  For each FSDP *unit* (a wrapped
module) it takes the unit's own parameters, those not owned by a nested unit,
in ``named_parameters()`` order, flattens them into one 1-D buffer, pads the end
with zeros to a multiple of the world size N, and gives rank r the r-th 1/N.
One buffer means one all-gather and one reduce-scatter per unit, not one per
tensor.

    unit = Linear(3 -> 2) (weight 2x3, bias 2), world size N = 4

    named_parameters():  weight (6 numbers)        bias (2)
    flat (unpadded):     w0 w1 w2 w3 w4 w5 | b0 b1          numel = 8
    padded to 4 * 2:     w0 w1 w2 w3 w4 w5 | b0 b1          (8 is a multiple of 4: no padding)

    unit = Linear(3 -> 3) (weight 3x3, bias 3), N = 4: numel 12 -> 12, but with
    Linear(3 -> 2) + a 1-number scale it is 9 -> padded to 12 (3 zeros "p"):

    flat:    w0 w1 w2 w3 w4 w5 b0 b1 s0  p  p  p
             |--rank 0--|--rank 1--|--rank 2--|--rank 3--|
    rank 0 keeps [w0 w1 w2], rank 1 [w3 w4 w5], rank 2 [b0 b1 s0], rank 3 [p p p]

A parameter may straddle two shards (rank 1 holds half of one tensor): a shard
is a slice of numbers, not of tensors.  When the unit runs, the shards are
all-gathered back into the full flat buffer and every original parameter
becomes a *view* into it (``unflatten``): no copy, and a gradient that flows
into the views lands in the flat buffer's gradient.

Note (layout parity with torch): the order is exactly torch FSDP1's
(``torch/distributed/fsdp/_flat_param.py``, ``use_orig_params=False``):
``module.named_modules()`` then each submodule's own parameters, a parameter
seen again (a tied weight) is *shared*, not flattened twice, and the shard is
``flat.chunk(N)[r]`` padded with zeros to the first chunk's size, which is the
same as padding the end to a multiple of N.  With ``align_numel > 0`` (torch
does this for ``use_orig_params=True``: 16 bytes, 4 fp32 numbers) each
parameter starts at a multiple of ``align_numel``.  Our gaps and end padding hold
zeros.  torch's end padding is zeros too when ``use_orig_params=False`` (``F.pad`` in
``FlatParamHandle._get_shard``), but with alignment it fills gaps and end padding with
42 (``_FLAT_PARAM_PADDING_VALUE``, a marker for debugging): those positions are never
read as a parameter, so compare shards without them.

Note (tied weights): TinyGPT's ``lm_head.weight is tok_emb.weight``.  The
tensor is stored once (at ``tok_emb.weight``, the first name met); the second
name is recorded in ``layout.shared`` and gets the *same* view object, so both
uses' gradients are summed by autograd before they reach the flat gradient.

Note (frozen parameters, buffers): buffers (TinyGPT's causal mask) are never
flattened or sharded; every rank keeps them whole.  A flat parameter has one
``requires_grad``; a unit mixing frozen and trainable parameters needs
``use_orig_params=True`` (as in torch), where frozen views are detached.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn

__all__ = ["ParamSlot", "SharedSlot", "FlatParamLayout", "padded_size", "overlap", "build_layout", "flatten", "shard",
           "unflatten"]


def padded_size(numel: int, world_size: int) -> int:
    """``numel`` rounded up to a multiple of N: 9 numbers on 4 ranks -> 12 (shards of 3)."""
    return -(-numel // world_size) * world_size


def overlap(offset: int, numel: int, start: int, end: int) -> tuple[int, int, int, int] | None:
    """The part of the numbers ``[offset, offset + numel)`` that lies in the window ``[start, end)``.

        numbers         [offset ............... offset+numel)
        window                  [start ................... end)
        overlap                 [a ............ b)

    Returns ``(a - offset, b - offset, a - start, b - start)``: the overlap counted
    from the start of the numbers, then from the start of the window; None if empty.
    A parameter's numbers against a shard: ``(lo, hi)`` are the parameter's, the
    last two the shard's.
    """
    a, b = max(offset, start), min(offset + numel, end)
    return (a - offset, b - offset, a - start, b - start) if a < b else None


@dataclass
class ParamSlot:
    """Where one original parameter lives in the flat buffer."""

    fqn: str  # name inside the unit's module, e.g. "attn.qkv.weight"
    module: nn.Module  # the module that owns the attribute
    name: str  # the attribute on that module, e.g. "weight"
    shape: torch.Size
    offset: int  # first index in the flat buffer
    numel: int
    requires_grad: bool
    param: nn.Parameter | None  # the original parameter; None once flattened away (use_orig_params=False)


@dataclass
class SharedSlot:
    """A second name for a parameter already in the buffer (a tied weight)."""

    fqn: str
    module: nn.Module
    name: str
    primary: int  # index of the ParamSlot it shares


@dataclass
class FlatParamLayout:
    """The map between original parameters and the flat buffer, for world size N.

    ``numel``: end of the last parameter; ``padded_numel``: a multiple of N;
    ``shard_numel = padded_numel // N``: what every rank keeps.
    """

    slots: list[ParamSlot]
    shared: list[SharedSlot] = field(default_factory=list)
    world_size: int = 1
    numel: int = 0
    padded_numel: int = 0

    @property
    def shard_numel(self) -> int:
        return self.padded_numel // self.world_size

    def shard_range(self, rank: int) -> tuple[int, int]:
        """[start, end) of rank's shard in flat coordinates."""
        return rank * self.shard_numel, (rank + 1) * self.shard_numel

    def local_pieces(self, rank: int) -> list[tuple[int, int]]:
        """For each slot, the [lo, hi) of the rank's shard (shard coordinates) it covers; lo == hi if none."""
        start, end = self.shard_range(rank)
        cuts = [overlap(s.offset, s.numel, start, end) for s in self.slots]
        return [(cut[2], cut[3]) if cut else (0, 0) for cut in cuts]

    def picture(self, rank_width: int = 12) -> str:
        """A one-line-per-rank ASCII picture of which parameters each shard holds."""
        lines = []
        for r in range(self.world_size):
            names = [
                f"{s.fqn}[{lo + r * self.shard_numel - s.offset}:{hi + r * self.shard_numel - s.offset}]"
                for s, (lo, hi) in zip(self.slots, self.local_pieces(r))
                if hi > lo
            ]
            start, end = self.shard_range(r)
            pad = max(0, end - max(start, self.numel))
            lines.append(f"rank {r}: [{start:>{rank_width}}, {end:>{rank_width}})  " + " | ".join(names)
                         + (f" | padding x{pad}" if pad else ""))
        return "\n".join(lines)


def build_layout(module: nn.Module, params: list[nn.Parameter], world_size: int, align_numel: int = 0):
    """Lay out ``params`` (the unit's own parameters) of ``module`` in torch FSDP1's order.

    Walks ``module.named_modules(remove_duplicate=False)`` and each submodule's
    own parameters (duplicates included), keeps those in ``params``; the first
    name met for a tensor owns it, later names become :class:`SharedSlot` s.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    wanted = set(params)
    slots: list[ParamSlot] = []
    shared: list[SharedSlot] = []
    first_slot: dict[nn.Parameter, int] = {}
    offset = 0
    for mod_name, mod in module.named_modules(remove_duplicate=False):
        for name, p in list(mod._parameters.items()):
            if p is None or p not in wanted:
                continue
            fqn = f"{mod_name}.{name}" if mod_name else name
            if p in first_slot:
                shared.append(SharedSlot(fqn, mod, name, first_slot[p]))
                continue
            if align_numel and offset % align_numel:
                offset += align_numel - offset % align_numel
            first_slot[p] = len(slots)
            slots.append(ParamSlot(fqn, mod, name, p.shape, offset, p.numel(), p.requires_grad, p))
            offset += p.numel()
    if not slots:
        raise ValueError("build_layout: none of the given parameters were found in the module")
    return FlatParamLayout(slots, shared, world_size, offset, padded_size(offset, world_size))


def flatten(layout: FlatParamLayout, tensors: list[torch.Tensor] | None = None) -> torch.Tensor:
    """Copy the slots' parameters (or ``tensors``, one per slot) into a new 1-D buffer of ``padded_numel``.

    Padding and alignment gaps are zeros.  Shape: (padded_numel,).
    """
    tensors = tensors if tensors is not None else [s.param for s in layout.slots]
    ref = tensors[0]
    flat = torch.zeros(layout.padded_numel, dtype=ref.dtype, device=ref.device)
    with torch.no_grad():
        for s, t in zip(layout.slots, tensors):
            flat[s.offset : s.offset + s.numel].copy_(t.reshape(-1))
    return flat


def shard(flat: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Rank's 1/N of a padded flat buffer, as a new tensor (it owns its memory). Shape: (numel // N,)."""
    if flat.numel() % world_size:
        raise ValueError(f"flat buffer of {flat.numel()} numbers does not split into {world_size} equal shards; pad it")
    size = flat.numel() // world_size
    return flat[rank * size : (rank + 1) * size].clone()


def unflatten(flat: torch.Tensor, layout: FlatParamLayout) -> list[torch.Tensor]:
    """Views of the full flat buffer, one per slot, in the original shapes (no copy).

    One ``split`` (as torch does) so that autograd sees a single SplitBackward:
    the gradients of all views are gathered into one flat gradient.
    """
    sizes, keep = [], []
    pos = 0
    for s in layout.slots:
        if s.offset > pos:  # an alignment gap
            sizes.append(s.offset - pos)
            keep.append(False)
        sizes.append(s.numel)
        keep.append(True)
        pos = s.offset + s.numel
    if flat.numel() != layout.numel:
        flat = flat[: layout.numel]
    pieces = flat.split(sizes)
    views = [p for p, k in zip(pieces, keep) if k]
    return [v.view(s.shape) for v, s in zip(views, layout.slots)]
