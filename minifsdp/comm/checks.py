"""Chapter 2.2: what every collective of ours checks before it moves a byte.

Two kinds of mistakes:

* **local** ones, seen by the rank that makes them (:func:`check_ready`, :func:`check_sizes`): no
  process group yet, a rank outside the group, a non-contiguous tensor, an unsupported dtype or op,
  output and input of different dtypes or of sizes that do not fit.  The error says how to fix it.
* **across ranks** (:func:`agree_on_call`): every rank must call the same collective on tensors of
  the same size and dtype with the same op.  If one does not, gloo would abort the process (a
  message longer than the receive posted for it) or wait forever.  So every rank first sends every
  other rank a small header, ``[collective, numel, dtype, op, extra]``, and compares: if any row
  differs, *every* rank raises the same ``ValueError`` listing all ranks, and nothing hangs::

        rank 0 --header--> ranks 1, 2, ...       every rank reads every row,
        rank 1 --header--> ranks 0, 2, ...       then all raise, or all go on

  That is N(N-1) small messages: fine for a textbook.  The tuned ring sends 2(N-1) instead and
  carries small tensors in the header (:mod:`minifsdp.comm.tuned.header`).  Headers are control
  traffic: ``count_bytes`` does not count them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["OPS", "DTYPES", "KINDS", "check_ready", "check_sizes", "agree_on_call", "header_row", "mismatch_error"]

OPS = ("sum", "avg")
DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16,
          torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)
KINDS = ("all_reduce", "reduce_scatter", "all_gather", "naive_all_reduce")
CHECK_TAG = 0x6D63  # the textbook's headers ("mc"): never matches data (tag 0) nor the tuned ring's headers


def check_ready(name: str, group, tensors: dict[str, torch.Tensor], op=None) -> tuple[object, str]:
    """Clear errors for the usual mistakes; returns (group, op name: "sum" or "avg")."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            f"{name} was called before the process group exists: call "
            "torch.distributed.init_process_group(...) first, "
            "or run your function with minifsdp.spawn(fn, world_size=N)."
        )
    group = group if group is not None else dist.group.WORLD
    if dist.get_rank(group) < 0:
        raise ValueError(f"{name}: this rank ({dist.get_rank()}) is not a member of the given group; "
                         "call collectives only on ranks that belong to the group.")
    for label, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: {label} must be a torch.Tensor, got {type(t).__name__}.")
        if not t.is_contiguous():
            raise ValueError(f"{name}: {label} is not contiguous (shape {tuple(t.shape)}, stride {t.stride()}); "
                             "pass t.contiguous() and copy the result back if you need it in t.")
        if t.dtype not in DTYPES:
            raise TypeError(f"{name}: dtype {t.dtype} is not supported; use one of {[str(d) for d in DTYPES]}.")
    dtypes = {t.dtype for t in tensors.values()}
    if len(dtypes) > 1:
        raise TypeError(f"{name}: output and input must have the same dtype, got {sorted(map(str, dtypes))}.")
    if op is None:
        return group, "sum"
    key = op.lower() if isinstance(op, str) else _reduce_op_name(op)
    if key not in OPS:
        raise ValueError(f"{name}: op={op!r} is not supported by our ring collectives; use 'sum' or 'avg' "
                         "(or dist.ReduceOp.SUM / AVG); for MAX/MIN/PRODUCT use torch.distributed.all_reduce.")
    if key == "avg" and not next(iter(dtypes)).is_floating_point:
        raise TypeError(f"{name}: op='avg' on integer tensors is ambiguous (floor? round?); "
                        "use op='sum' and divide the result yourself.")
    return group, key


def _reduce_op_name(op) -> str | None:
    """'sum' / 'avg' for dist.ReduceOp.SUM / AVG, else None."""
    for name, torch_op in (("sum", dist.ReduceOp.SUM), ("avg", dist.ReduceOp.AVG)):
        try:
            if op == torch_op:
                return name
        except TypeError:
            return None
    return None


def check_sizes(name: str, big: torch.Tensor, small: torch.Tensor, group) -> int:
    """``big`` must hold world_size x ``small`` elements (reduce-scatter's input, all-gather's output); returns N."""
    n = dist.get_world_size(group)
    big_name, small_name = ("input", "output") if name.endswith("reduce_scatter") else ("output", "input")
    if big.numel() != n * small.numel():
        raise ValueError(f"{name}: {big_name} has {big.numel()} elements but must have world_size x "
                         f"{small_name}.numel() = {n} x {small.numel()} = {n * small.numel()}.")
    return n


def header_row(kind: str, tensor: torch.Tensor, op: str, extra: int = 0) -> list[int]:
    """What every rank must agree on, as numbers: [collective, numel, dtype, op, extra (naive's root)]."""
    return [KINDS.index(kind), tensor.numel(), DTYPES.index(tensor.dtype), OPS.index(op), extra]


def mismatch_error(kind: str, table: list[list[int]]) -> ValueError:
    """The error every rank raises when the rows of ``table`` (one per rank, in rank order) differ."""
    lines = [f"  rank {i}: {KINDS[k]}, {numel} elements of {DTYPES[d]}, op={OPS[o]}, root={e}"
             for i, (k, numel, d, o, e, *_) in enumerate(table)]
    return ValueError(
        f"{kind}: the ranks called different collectives or passed different tensors:\n" + "\n".join(lines)
        + "\nEvery rank must call the same collective with a tensor of the same size and dtype, and the same op."
    )


def agree_on_call(group, kind: str, tensor: torch.Tensor, op: str, extra: int = 0) -> None:
    """Every rank sends its header to every other rank and compares; all raise together if any differs."""
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    mine = torch.tensor(header_row(kind, tensor, op, extra), dtype=torch.int64)
    rows = [mine if i == rank else torch.empty_like(mine) for i in range(n)]
    peers = [i for i in range(n) if i != rank]
    works = [dist.isend(mine, dist.get_global_rank(group, i), group=group, tag=CHECK_TAG) for i in peers]
    works += [dist.irecv(rows[i], dist.get_global_rank(group, i), group=group, tag=CHECK_TAG) for i in peers]
    for work in works:
        work.wait()
    table = [row.tolist() for row in rows]
    if any(row != table[0] for row in table):
        raise mismatch_error(kind, table)
