"""Chapter 5 pictures and counts: FSDP1's flat shard beside FSDP2's per-parameter rows.

The same two weights, N = 2, laid out both ways (what :func:`plot_layouts` draws for a whole block)::

    weights: a (3 x 4 = 12 numbers), b (3 numbers)          FSDP1 (flat):   a0..a11 b0 b1 b2 .  (16, padded)
                                                            rank 0: a0 .. a7          rank 1: a8 .. a11 b0 b1 b2 pad
    FSDP2 (per parameter, rows of dim 0, ceil(3/2) = 2 rows each):
                                                            rank 0: a[0:2]  b[0:2]
                                                            rank 1: a[2:3]+pad row   b[2:3]+pad

FSDP1's padding is at the end of the unit, on the last rank only (at most N-1 numbers per unit); FSDP2's is
per parameter, on every rank whose chunk is short (up to ``(N*ceil(d0/N) - d0) * row`` numbers per weight).

What is here:

* :func:`record_collectives` -- a context manager that logs every ``all_gather_single`` /
  ``reduce_scatter_single`` torch.distributed call (both torch's FSDP2 and our ``fully_shard``
  with ``collectives="torch"`` make exactly these calls), as ``(kind, numel, dtype)``.
* :func:`fsdp2_padding` / :func:`fsdp1_padding` -- padding elements per rank, read from the real shards
  (ours, torch's FSDP2) or from the FSDP1 flat layout of the same units.
* :func:`local_shapes` -- each parameter's local (this rank's) shape, ours or torch's.
* :func:`plot_layouts` -- the picture.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.distributed as dist
import torch.nn as nn

from minifsdp.fsdp.core.flat_param import build_layout
from minifsdp.fsdp2.core import fsdp_state
from minifsdp.fsdp2.core.param import chunk_rows, local_row_range

__all__ = ["record_collectives", "format_collectives", "fsdp2_padding", "fsdp1_padding", "local_shapes",
           "units_of", "plot_layouts"]

_NAMES = {"all_gather_single": "AG", "reduce_scatter_single": "RS"}


@contextlib.contextmanager
def record_collectives(log: list):
    """Append ``(kind, numel of this rank's input, dtype)`` for each all-gather / reduce-scatter in the block.

    Replaces ``dist.all_gather_single`` and ``dist.reduce_scatter_single`` for the duration (the calls are
    looked up on ``torch.distributed`` at each use, by torch's FSDP2 and by ours), and puts them back.
    """
    saved = {name: getattr(dist, name) for name in _NAMES}

    def recording(name, fn):
        def call(output, input, *args, **kwargs):
            log.append((_NAMES[name], input.numel(), str(input.dtype).replace("torch.", "")))
            return fn(output, input, *args, **kwargs)
        return call

    for name, fn in saved.items():
        setattr(dist, name, recording(name, fn))
    try:
        yield log
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


def format_collectives(log: list) -> str:
    """``AG 4160 | AG 12704 | ... `` (numel per rank's input; dtype shown only when not float32)."""
    return " | ".join(f"{k} {n}" + ("" if d == "float32" else f" {d}") for k, n, d in log)


def units_of(model: nn.Module) -> dict[str, list[tuple[str, nn.Parameter]]]:
    """The parameters of each wrapping unit of a TinyGPT, as the book shards it: each block, then the root's rest.

    The tied ``lm_head.weight`` is ``tok_emb.weight``: listed once (``named_parameters`` drops duplicates).
    """
    units: dict[str, list[tuple[str, nn.Parameter]]] = {}
    for name, p in model.named_parameters():
        unit = ".".join(name.split(".")[:2]) if name.startswith("blocks.") else "root"
        units.setdefault(unit, []).append((name, p))
    return dict(sorted(units.items(), key=lambda kv: kv[0] == "root"))


def _torch_fsdp_params(module: nn.Module) -> list:
    group = module._get_fsdp_state()._fsdp_param_group
    return [] if group is None else group.fsdp_params


def fsdp2_padding(modules: list[nn.Module], impl: str) -> tuple[int, int]:
    """(padding elements in this rank's shards, padding elements in one all-gather of all of them).

    Read from the real objects: ours ``FSDPParam.padded_local`` vs ``sharded_param.to_local()``; torch's
    ``FSDPParam._sharded_param_data`` (its padded 1-D storage) vs ``sharded_param.to_local()``.
    """
    mine = gathered = 0
    for m in modules:
        if impl == "ours":
            state = fsdp_state(m)
            params = [] if state is None or state.param_group is None else state.param_group.fsdp_params
            pairs = [(p.padded_local.numel(), p.local_tensor.numel(), p.world_size, p.full_size) for p in params]
        else:
            params = _torch_fsdp_params(m)
            pairs = [(p._sharded_param_data.numel(), p.sharded_param.to_local().numel(),
                      p.mesh_info.shard_mesh_size, p._orig_size) for p in params]
        for padded, local, n, full in pairs:
            mine += padded - local
            gathered += n * padded - math.prod(full)
    return mine, gathered


def fsdp1_padding(model: nn.Module, world_size: int, rank: int) -> tuple[int, int]:
    """(padding elements in ``rank``'s flat shards, padding in the gathered flat parameters), FSDP1's layout
    (``minifsdp.fsdp.core.flat_param.build_layout``, torch FSDP1's) of the units :func:`units_of` lists."""
    mine = gathered = 0
    for _, named in units_of(model).items():
        layout = build_layout(model, [p for _, p in named], world_size)
        lo, hi = layout.shard_range(rank)
        mine += max(0, hi - max(lo, layout.numel))
        gathered += layout.padded_numel - layout.numel
    return mine, gathered


def local_shapes(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """Each parameter's local shape on this rank (a DTensor's ``to_local().shape``, ours' and torch's alike)."""
    return {n: tuple(p.to_local().shape) if hasattr(p, "to_local") else tuple(p.shape)
            for n, p in model.named_parameters()}


def plot_layouts(named: list[tuple[str, torch.Size]], world_size: int, ax=None, title: str | None = None):
    """Two rows per rank: FSDP1's flat slice of the unit (top) and FSDP2's rows of each parameter (bottom).

    ``named``: (name, full shape) of the unit's parameters in order.  Hatched: padding.  Widths are elements.
    """
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(10, 1.2 + 0.9 * world_size))
    colors = plt.get_cmap("tab20").colors
    numels = [math.prod(s) for _, s in named]
    total = sum(numels)
    shard = math.ceil(total / world_size)
    starts = [sum(numels[:i]) for i in range(len(numels))]
    for r in range(world_size):
        y1, y2 = 2 * (world_size - 1 - r) + 1, 2 * (world_size - 1 - r)
        lo, hi = r * shard, (r + 1) * shard
        x = 0
        for i, (start, n) in enumerate(zip(starts, numels, strict=True)):  # FSDP1: a slice of the flat vector
            w = max(0, min(hi, start + n) - max(lo, start))
            if w:
                ax.barh(y1, w, left=x, color=colors[i % 20], edgecolor="white", linewidth=0.3)
                x += w
        if x < shard:
            ax.barh(y1, shard - x, left=x, color="white", edgecolor="grey", hatch="///", linewidth=0.3)
        x = 0
        for i, (_, size) in enumerate(named):  # FSDP2: this rank's rows of every parameter, each padded
            row = math.prod(size[1:])
            c = chunk_rows(size[0], world_size)
            a, b = local_row_range(size[0], world_size, r)
            ax.barh(y2, (b - a) * row, left=x, color=colors[i % 20], edgecolor="white", linewidth=0.3)
            if c - (b - a):
                ax.barh(y2, (c - (b - a)) * row, left=x + (b - a) * row, color="white", edgecolor="grey",
                        hatch="///", linewidth=0.3)
            x += c * row
    ax.set_yticks([v for r in range(world_size) for v in (2 * (world_size - 1 - r) + 1, 2 * (world_size - 1 - r))])
    ax.set_yticklabels([f"rank {r} {k}" for r in range(world_size) for k in ("FSDP1 flat", "FSDP2 rows")])
    ax.set_xlabel("elements held by the rank (hatched: padding)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=colors[i % 20]) for i in range(len(named))]
    ax.legend(handles, [n for n, _ in named], fontsize=7, ncol=min(5, len(named)), loc="upper center",
              bbox_to_anchor=(0.5, -0.35 if world_size < 3 else -0.25))
    ax.set_title(title or f"the same parameters at N = {world_size}")
    return ax
