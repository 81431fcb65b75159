"""What the fuzzer looks at while a program runs: tensors as a user sees them, and the collectives issued.

Tensors.  :func:`tensors_of` turns whatever a user reads (``named_parameters()``, a state dict, an optimizer
state dict, a gradient) into a flat list of ``(path, kind, value)`` with every tensor a plain CPU tensor: a
``DTensor`` or a ``ShardedTensor`` by its global shape and this rank's piece, so the two sides compare bit for
bit whichever wrapper each returns; :func:`types_of` records the wrappers themselves, compared on their own.

Collectives.  :class:`CollectiveRecorder` is a ``TorchDispatchMode``: since torch 2.0 every process-group call
goes through the dispatcher as a ``c10d.*`` op, so it sees torch's collectives and ours alike, in the order
they were issued, each as ``(kind, numel, dtype)``.  Torch's names differ by entry point (``_allgather_base_``,
``allgather_into_tensor_coalesced_``); the kind is what it does.
"""

from __future__ import annotations

import torch
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["CollectiveRecorder", "tensors_of", "types_of", "error_of"]

_KINDS = (("reduce_scatter", "reduce-scatter"), ("allgather", "all-gather"), ("allreduce", "all-reduce"),
          ("broadcast", "broadcast"), ("barrier", "barrier"), ("alltoall", "all-to-all"), ("gather", "gather"),
          ("scatter", "scatter"), ("send", "send"), ("recv", "recv"))


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)


class CollectiveRecorder(TorchDispatchMode):
    """Every c10d op this rank issues while active, as ``(kind, numel, dtype)``; ``log`` in issue order."""

    def __init__(self):
        super().__init__()
        self.log: list[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "c10d":
            name = func._opname
            kind = next((k for key, k in _KINDS if key in name), name)
            # the output's size for an all-gather, the input's for a reduce-scatter: a unit's padded flat size
            operand = args[1] if kind == "reduce-scatter" and len(args) > 1 else args[0] if args else ()
            tensors = list(_tensors(operand))
            if kind != "barrier":
                self.log.append((kind, sum(t.numel() for t in tensors),
                                 str(tensors[0].dtype).replace("torch.", "") if tensors else None))
        return func(*args, **(kwargs or {}))

    def take(self) -> list[tuple]:
        """The log since the last take, and a fresh one."""
        out, self.log = self.log, []
        return out


def _plain(t: torch.Tensor) -> tuple[str, torch.Tensor]:
    """(what a tensor holds, its local numbers as a plain detached CPU tensor).  A ``DTensor`` and a
    ``ShardedTensor`` both read as ``sharded(global shape)`` with this rank's piece: which class carries the piece
    is recorded apart (:func:`types_of`), so the numbers are compared whichever wrapper a side chose."""
    if isinstance(t, DTensor):
        return f"sharded{tuple(t.shape)}", _empty_flat(t.to_local().detach().cpu()).clone()
    if isinstance(t, ShardedTensor):
        shards = [s.tensor.detach().cpu() for s in t.local_shards()]
        local = shards[0] if len(shards) == 1 else torch.cat([s.reshape(-1) for s in shards]) if shards \
            else torch.empty(0, dtype=t.dtype)
        return f"sharded{tuple(t.size())}", _empty_flat(local).clone()
    kind = "Parameter" if isinstance(t, torch.nn.Parameter) else "Tensor"
    return kind, t.detach().cpu().clone()


def _empty_flat(local: torch.Tensor) -> torch.Tensor:
    """A rank's empty piece as ``(0,)``: a ShardedTensor gives it that shape, a DTensor the parameter's other dims;
    with no numbers in it, the shape is only each wrapper's habit."""
    return local.reshape(0) if local.numel() == 0 else local


def types_of(obj) -> list[tuple[str, str]]:
    """``(key, class)`` of each value of a state dict: ``DTensor(placements)``, ``ShardedTensor``, ``Tensor``."""
    return [(str(k), f"DTensor{tuple(v.placements)}" if isinstance(v, DTensor) else type(v).__name__)
            for k, v in obj.items()]


def tensors_of(obj, prefix: str = "") -> list[tuple[str, str, object]]:
    """``(path, kind, value)`` for every leaf of ``obj`` (dicts by key, lists by index); tensors made plain."""
    out = []
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += tensors_of(v, f"{prefix}{k}.")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            out += tensors_of(v, f"{prefix}{i}.")
    elif isinstance(obj, torch.Tensor):
        kind, value = _plain(obj)
        out.append((prefix.rstrip("."), kind, value))
    else:
        out.append((prefix.rstrip("."), type(obj).__name__, obj if isinstance(obj, (int, float, str, bool,
                                                                                     type(None))) else repr(obj)))
    return out


def error_of(e: BaseException) -> str:
    """An exception as the fuzzer compares it: its type (messages are each side's own words)."""
    return type(e).__name__
