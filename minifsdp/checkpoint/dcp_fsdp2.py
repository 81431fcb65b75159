"""Chapter 5 checkpoints: our ``fully_shard`` model through ``torch.distributed.checkpoint`` (DCP), as torch FSDP2's.

Torch FSDP2's ``model.state_dict()`` holds DTensors (``Shard(0)`` on the mesh), and DCP reads from each one
which rows of the whole tensor this rank has: one *chunk* ``(offset, sizes)`` per rank.  Ours holds the same
rows (``torch.chunk``'s rule, see :mod:`minifsdp.fsdp2.param`) as plain local tensors that do not say where
they sit in the whole.  The adapter gives DCP that one missing fact and nothing else: each sharded entry
becomes ``DTensor.from_local(rows, mesh, [Shard(0)], shape=full, stride=...)``, a DTensor *view* of our
rows (no copy, no communication), so

    save:  dcp.save({"model": fsdp2_state_dict(model)}, ...)   writes rank r's rows as chunk r, exactly the
           chunks torch FSDP2 writes, so torch's ``dcp.load`` into its own ``fully_shard`` model reads them;
    load:  dcp.load({"model": fsdp2_state_dict(model)}, ...)   lets DCP copy the overlapping chunks of any
           DCP checkpoint (torch FSDP2's, FSDP1's sharded one, a full one) straight into our parameters.

    weight (5 rows), 2 ranks:  rank 0 rows 0-2 -> chunk offset (0, 0) sizes (3, d);
                               rank 1 rows 3-4 -> chunk offset (3, 0) sizes (2, d)

Buffers are replicated and stay plain tensors (DCP writes each once, from one rank).  Names are the original
fully qualified names (``blocks.0.attn.qkv.weight``), as torch FSDP2's ``state_dict()``.

Note (scope): 1-D sharding only (``mesh=None``, a 1-D mesh or a process group covering the world); HSDP's 2-D
mesh would need ``(Replicate(), Shard(0))`` placements and is refused.  The optimizer's state is not
adapted here (see :mod:`minifsdp.checkpoint.dcp` for a full-tensor route).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from minifsdp.fsdp2.param import ShardedParameter

__all__ = ["fsdp2_state_dict", "save_fsdp2_dcp", "load_fsdp2_dcp"]


def _contiguous_stride(size: torch.Size) -> tuple[int, ...]:
    stride, acc = [], 1
    for n in reversed(size):
        stride.append(acc)
        acc *= n
    return tuple(reversed(stride))


def fsdp2_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` with each sharded parameter's local rows as a ``Shard(0)`` DTensor view of them.

    The DTensors share storage with the parameters: DCP's load writes into the model in place.
    """
    specs = {name: p._spec for name, p in model.named_parameters(remove_duplicate=False)
             if isinstance(p, ShardedParameter)}
    meshes: dict[int, DeviceMesh] = {}
    out = {}
    for name, value in model.state_dict().items():
        spec = specs.get(name)
        if spec is None:  # a buffer, or a parameter fully_shard did not take: replicated
            out[name] = value
            continue
        if spec.world_size != dist.get_world_size():
            raise NotImplementedError(f"{name}: sharded over {spec.world_size} of {dist.get_world_size()} ranks "
                                      "(HSDP or a subgroup); this adapter handles 1-D sharding over the world")
        if id(spec.group) not in meshes:
            meshes[id(spec.group)] = DeviceMesh.from_group(spec.group, device_type=value.device.type)
        out[name] = DTensor.from_local(value, meshes[id(spec.group)], [Shard(0)], run_check=False,
                                       shape=spec.full_size, stride=_contiguous_stride(spec.full_size))
    return out


def save_fsdp2_dcp(directory: str, model: nn.Module) -> None:
    """Write our ``fully_shard`` model as ``{"model": state_dict}`` in DCP format, as torch FSDP2's; collective."""
    dcp.save({"model": fsdp2_state_dict(model)}, checkpoint_id=directory)


def load_fsdp2_dcp(directory: str, model: nn.Module) -> None:
    """Load ``{"model": ...}`` from a DCP checkpoint (torch FSDP2's, or :func:`save_fsdp2_dcp`'s) into our
    ``fully_shard`` model, in place; each rank reads only the chunks that overlap its rows; collective."""
    dcp.load({"model": fsdp2_state_dict(model)}, checkpoint_id=directory)  # DCP copies into the views
