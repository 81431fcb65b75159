"""Flat parameters (chapter 2.1): many parameters -> one 1-D buffer -> N equal shards.

For each unit FSDP takes the unit's own parameters in ``named_parameters()`` order,
flattens them into one 1-D buffer, pads the end with zeros to a multiple of the world
size N, and gives rank r the r-th 1/N: one all-gather and one reduce-scatter per unit.

    Linear(3 -> 2) (weight 2x3, bias 2) + a 1-number scale, N = 4: numel 9 -> padded to 12

    flat:    w0 w1 w2 w3 w4 w5 b0 b1 s0  p  p  p
             |--rank 0--|--rank 1--|--rank 2--|--rank 3--|
    rank 0 keeps [w0 w1 w2], rank 1 [w3 w4 w5], rank 2 [b0 b1 s0], rank 3 [p p p]

Why one buffer, not a collective per parameter?  A GPT block has a dozen parameters, some of a few
hundred numbers, and a collective costs a fixed latency however small: one all-gather per unit is cheaper.

A shard is a slice of numbers, not of tensors: ``w3 w4 w5`` on rank 1 is half of a weight.
When the unit runs, the shards are all-gathered into the full buffer and every original
parameter becomes a *view* into it (:func:`unflatten`): no copy, and autograd sums the
views' gradients into the buffer's gradient, which is exactly what the reduce-scatter needs.

Note (layout parity with torch): torch FSDP1's order (``_flat_param.py``); a parameter seen again (a
tied weight, TinyGPT's ``lm_head.weight is tok_emb.weight``) is *shared* under its first name, not
flattened twice; the shard is ``flat.chunk(N)[r]`` padded to the first chunk's size (``_get_shard``).
A layout may leave gaps between parameters; :func:`unflatten` skips them.  Buffers stay whole.
"""

from dataclasses import dataclass, field

import torch
import torch.nn as nn


def padded_size(numel: int, world_size: int) -> int:
    """``numel`` rounded up to a multiple of N: 9 numbers on 4 ranks -> 12 (shards of 3)."""
    return -(-numel // world_size) * world_size

def overlap(offset: int, numel: int, start: int, end: int) -> tuple[int, int, int, int] | None:
    """The part ``[a, b)`` of the numbers ``[offset, offset + numel)`` inside the window ``[start, end)``:
    ``(a - offset, b - offset, a - start, b - start)`` (from the numbers' start, then the window's), or None."""
    a, b = max(offset, start), min(offset + numel, end)  # the intersection of two intervals
    return (a - offset, b - offset, a - start, b - start) if a < b else None

@dataclass
class ParamSlot:
    """Where one original parameter lives in the flat buffer."""
    fqn: str  # name inside the unit's module, e.g. "attn.qkv.weight"
    module: nn.Module  # the module that owns the attribute
    name: str  # the attribute on that module, e.g. "weight"
    shape: torch.Size  # its original shape, restored by unflatten's view
    offset: int  # first index in the flat buffer
    numel: int  # how many numbers it occupies, from offset
    requires_grad: bool
    param: nn.Parameter | None  # the original; None once the unit has taken it over (handle.py)

@dataclass
class SharedSlot:
    """A second name for a parameter already in the buffer (a tied weight)."""
    fqn: str
    module: nn.Module
    name: str
    primary: int  # index of the ParamSlot it shares

@dataclass
class FlatParamLayout:
    """The map between original parameters and the flat buffer, for world size N: ``numel`` ends the last
    parameter, ``padded_numel`` is a multiple of N, every rank keeps ``shard_numel = padded_numel // N``."""
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
        """For each slot, the [lo, hi) of rank's shard (shard coordinates) it covers; lo == hi if none."""
        start, end = self.shard_range(rank)
        cuts = [overlap(s.offset, s.numel, start, end) for s in self.slots]  # each slot against the shard
        return [(cut[2], cut[3]) if cut else (0, 0) for cut in cuts]

    def picture(self, rank_width: int = 12) -> str:
        """One line per rank: which parameters (and padding) each shard holds."""
        lines = []
        for r in range(self.world_size):
            start, end = self.shard_range(r)
            names = [f"{s.fqn}[{lo + start - s.offset}:{hi + start - s.offset}]"
                     for s, (lo, hi) in zip(self.slots, self.local_pieces(r)) if hi > lo]
            pad = max(0, end - max(start, self.numel))  # the zeros at the end fall on the last ranks
            lines.append(f"rank {r}: [{start:>{rank_width}}, {end:>{rank_width}})  " + " | ".join(names)
                         + (f" | padding x{pad}" if pad else ""))
        return "\n".join(lines)

def build_layout(module: nn.Module, params: list[nn.Parameter], world_size: int) -> FlatParamLayout:
    """Lay out ``params`` (the unit's own parameters) of ``module`` end to end in torch FSDP1's order; the
    first name met for a tensor owns it, later names become :class:`SharedSlot` s.

    torch's walk is the same: ``FlatParamHandle._init_flat_param_and_metadata`` visits
    ``module.named_modules(remove_duplicate=False)`` and records a tensor met again as shared."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    wanted, slots, shared, first_slot, offset = set(params), [], [], {}, 0  # offset: where the next one starts
    for mod_name, mod in module.named_modules(remove_duplicate=False):
        for name, p in list(mod._parameters.items()):
            if p is None or p not in wanted:
                continue
            fqn = f"{mod_name}.{name}" if mod_name else name
            if p in first_slot:  # met before under another name: a tied weight, stored once
                shared.append(SharedSlot(fqn, mod, name, first_slot[p]))
                continue
            first_slot[p] = len(slots)
            slots.append(ParamSlot(fqn, mod, name, p.shape, offset, p.numel(), p.requires_grad, p))
            offset += p.numel()
    if not slots:
        raise ValueError("build_layout: none of the given parameters were found in the module")
    return FlatParamLayout(slots, shared, world_size, offset, padded_size(offset, world_size))

def flatten(layout: FlatParamLayout, tensors: list[torch.Tensor] | None = None) -> torch.Tensor:
    """A new 1-D buffer of ``padded_numel``: the slots' parameters (or ``tensors``, one per slot), zeros elsewhere."""
    tensors = tensors if tensors is not None else [s.param for s in layout.slots]
    flat = torch.zeros(layout.padded_numel, dtype=tensors[0].dtype, device=tensors[0].device)  # padding: zeros
    with torch.no_grad():
        for s, t in zip(layout.slots, tensors):
            flat[s.offset : s.offset + s.numel].copy_(t.reshape(-1))
    return flat

def shard(flat: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Rank's 1/N of a padded flat buffer, as a new tensor that owns its memory. Shape: (numel // N,).

    Why a copy, not a slice?  A slice is a view: it would keep the whole full buffer's storage alive,
    and sharding saves nothing.  torch's ``FlatParamHandle.shard`` also takes a new shard (``_get_shard``),
    then resizes the full flat parameter's storage to 0 and points the parameter at the shard (``set_``)."""
    if flat.numel() % world_size:
        raise ValueError(f"flat buffer of {flat.numel()} numbers does not split into {world_size} equal shards; pad it")
    size = flat.numel() // world_size
    return flat[rank * size : (rank + 1) * size].clone()  # a copy: the full buffer can be freed

def unflatten(flat: torch.Tensor, layout: FlatParamLayout) -> list[torch.Tensor]:
    """Views of the full flat buffer, one per slot, in the original shapes (no copy).  One ``split``, as
    torch: autograd sees a single node that gathers the views' gradients into one flat gradient.

    torch's ``FlatParamHandle`` splits the same way (``torch.split(tensor, flat_param._numels)``) and views
    each piece in its shape; our ``sizes`` add a piece for each gap (and the padding after the last one, if
    ``flat`` has it), which ``keep`` then drops."""
    sizes, keep, pos = [], [], 0
    for s in layout.slots:
        gap = s.offset - pos  # a gap the layout left between two parameters: a piece nobody keeps
        sizes += [gap, s.numel] if gap else [s.numel]
        keep += [False, True] if gap else [True]
        pos = s.offset + s.numel
    tail = flat.numel() - pos  # the padding after the last one, where ``flat`` has it: nobody keeps it either
    sizes, keep = sizes + [tail] * bool(tail), keep + [False] * bool(tail)
    views = [p for p, k in zip(flat.split(sizes), keep) if k]  # 1-D pieces, then each viewed in its shape
    return [v.view(s.shape) for v, s in zip(views, layout.slots)]
