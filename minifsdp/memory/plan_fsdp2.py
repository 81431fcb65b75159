"""Chapter 5 at real scale: how ``fully_shard`` (FSDP2) lays a model's bytes out, for ``plan --impl fsdp2``.

FSDP1 flattens a unit's parameters into one vector and pads the vector once, to a multiple of the ranks.
FSDP2 shards each parameter by itself, by rows (``Shard(0)``): a weight of ``d0`` rows gives every rank a chunk
of ``c = ceil(d0 / N)`` rows, padded with zero rows where ``N`` does not divide ``d0`` (the last ranks' chunks are
shorter, or empty).  The padding is per parameter, so it is never more than ``N - 1`` rows of each weight.
:func:`chunk_rows` and :func:`local_row_range` are ``minifsdp.fsdp2.core.param``'s (this chapter may not import
chapter 5's; ``tests/test_plan_fsdp2.py`` holds the two pairs equal)::

    per rank, one unit (group):  padded  = sum over its parameters of c x (elements per row)
                                 local_r = sum of the rows rank r really owns x (elements per row)

What each number is, read in torch's ``_fully_shard/_fsdp_param.py`` and ``_fsdp_collectives.py``:

* the sharded parameter's storage is its padded chunk (``_sharded_param_data``), one per parameter: ``padded``;
* the all-gather input of a group is its parameters' padded chunks side by side, ``padded`` elements per rank
  (``foreach_all_gather``), and the output ``N x padded``: the gathered copy, in the compute dtype;
* the reduce-scatter's output is one flat buffer of ``padded`` elements (``foreach_reduce``), cast to the
  parameters' dtype as a whole, and every ``.grad`` is a view into it: the gradients hold ``padded`` too;
  with CPU offload each ``.grad`` is copied to the CPU at its own (unpadded) size: ``local_r``;
* the optimizer's state is made like each ``.grad``'s local tensor (``zeros_like``): ``local_r``, and AdamW
  keeps one ``step`` per parameter (FSDP1: per flat parameter).

So FSDP2's optimizer state differs by rank (the last ranks may own fewer rows), its parameters and gradients do
not.  ``tests/test_plan_fsdp2_measured.py`` holds these sums to the byte against ``fully_shard`` at 2 ranks.

``reshard_after_forward`` (torch's ``_fsdp_init._get_post_forward_mesh_info``): True frees a group's gathered
parameters after its forward and gathers them again in the backward; False keeps them (no second all-gather:
SHARD_GRAD_OP's memory); an int k (dividing N) keeps ``1/k`` of the gathered copy on each rank
(``_sharded_post_forward_param_data``), and the backward's all-gather runs among k ranks (e.g. one node's);
torch reads k = 1 as False and k = N as True.  Left as torch's default (None), the root is never resharded
(``FSDPState._lazy_init``: its backward starts at once), every other group is.  torchtitan's ``apply_fsdp``
also keeps the last block (pytorch/torchtitan, ``torchtitan/models/llama3/infra/parallelize.py``: "do not
reshard after forward for the last transformer block since FSDP would prefetch it immediately").
"""

from __future__ import annotations

import math

from minifsdp.memory.plan_shapes import ModelShape

__all__ = ["RESHARD_CHOICES", "chunk_rows", "local_row_range", "padded_shards", "local_elements", "tensor_count",
           "reshard_group", "kept_after_forward"]

RESHARD_CHOICES = ("true", "false", "torchtitan")  # or a whole number k


def chunk_rows(d0: int, n: int) -> int:
    """Rows of one rank's padded chunk of a ``d0``-row parameter: ``ceil(d0 / N)`` (``torch.chunk``'s rule)."""
    return max(1, math.ceil(d0 / n))


def local_row_range(d0: int, n: int, rank: int) -> tuple[int, int]:
    """``[start, end)``: the rows ``rank`` owns (empty for the last ranks when ``d0`` is small)."""
    c = chunk_rows(d0, n)
    start = min(rank * c, d0)
    return start, min(start + c, d0)


def padded_shards(shape: ModelShape, wrap: str, n: int) -> list[int]:
    """Elements of each unit's padded chunks on one rank (the same on every rank): the all-gather input, the
    sharded parameters' storage, the reduce-scatter output."""
    return [sum(chunk_rows(rows, n) * per_row for rows, per_row in unit) for unit in shape.tensor_shapes(wrap)]


def local_elements(shape: ModelShape, wrap: str, n: int, rank: int) -> list[int]:
    """Elements of each unit's rows that ``rank`` really owns (no padding): the optimizer state's size."""
    out = []
    for unit in shape.tensor_shapes(wrap):
        total = 0
        for rows, per_row in unit:
            start, end = local_row_range(rows, n, rank)
            total += (end - start) * per_row
        out.append(total)
    return out


def tensor_count(shape: ModelShape, wrap: str) -> int:
    """Parameters the optimizer steps: one AdamW ``step`` each (FSDP2 keeps the parameters as they were)."""
    return sum(len(unit) for unit in shape.tensor_shapes(wrap))


def reshard_group(value: str, shard_size: int) -> str:
    """``value`` as torch reads it at this shard group size: "true", "false", "torchtitan" or k (2 <= k < N, as a
    string); k = 1 is "false" and k = N "true" (torch's ``_get_post_forward_mesh_info``).  ValueError (one line,
    naming the flag) if k does not divide N."""
    if value in RESHARD_CHOICES:
        return value
    k = int(value)
    if k < 1 or shard_size % k:
        raise ValueError(f"--reshard-after-forward {k}: an int is the ranks to reshard to after forward and must "
                         f"divide the {shard_size} ranks a parameter is sharded over (e.g. 8, the GPUs of a node); "
                         f"or give true, false or torchtitan")
    return "false" if k == 1 else "true" if k == shard_size else str(k)


def kept_after_forward(value: str, unit: int, units: int, root: bool) -> float:
    """The share of unit ``unit``'s gathered copy a rank keeps from its forward to its backward: 0 (freed,
    gathered again), 1 (kept) or 1/k.  The root (``unit`` 0 when ``root``) is kept, as torch's default None."""
    if (root and unit == 0) or value == "false":
        return 1.0
    if value == "torchtitan":
        return 1.0 if unit == units - 1 else 0.0
    return 0.0 if value == "true" else 1.0 / int(value)
