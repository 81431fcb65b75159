"""Chapter 5 checkpoints: our ``fully_shard`` model through ``torch.distributed.checkpoint`` (DCP), as torch FSDP2's.

DCP reads from each DTensor in a state dict which rows of the whole tensor this rank has: one *chunk*
``(offset, sizes)`` per rank.  Our ``fully_shard`` labels its sharded parameters as DTensors (``Shard(0)``
on the mesh, see :mod:`minifsdp.fsdp2.core.param`) over the same rows as torch's (``torch.chunk``'s rule), and its
``state_dict()`` first reshards any group a forward left gathered, so ``model.state_dict()`` is already what
DCP needs, with the original fully qualified names (``blocks.0.attn.qkv.weight``)::

    weight (5 rows), 2 ranks:  rank 0 rows 0-2 -> chunk offset (0, 0) sizes (3, d);
                               rank 1 rows 3-4 -> chunk offset (3, 0) sizes (2, d)

    save:  dcp.save({"model": model.state_dict()}, ...)  writes rank r's rows as chunk r, exactly the chunks
           torch FSDP2 writes, so torch's ``dcp.load`` into its own ``fully_shard`` model reads them;
    load:  dcp.load({"model": model.state_dict()}, ...)  copies the overlapping chunks of any DCP checkpoint
           (torch FSDP2's, FSDP1's sharded one, a full one) straight into our parameters' local rows.

HSDP's ``(Replicate(), Shard(0))`` DTensors go through the same calls (DCP writes each chunk once).  Buffers are
replicated plain tensors (DCP writes each once, from one rank).  The optimizer's state is not adapted here
(see :mod:`minifsdp.checkpoint.dcp` for a full-tensor route).
"""

from __future__ import annotations

import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn

__all__ = ["fsdp2_state_dict", "save_fsdp2_dcp", "load_fsdp2_dcp"]


def fsdp2_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model.state_dict()``: its sharded entries are DTensors sharing storage with the parameters, so DCP's
    load writes into the model in place."""
    return model.state_dict()


def save_fsdp2_dcp(directory: str, model: nn.Module) -> None:
    """Write our ``fully_shard`` model as ``{"model": state_dict}`` in DCP format, as torch FSDP2's; collective."""
    dcp.save({"model": fsdp2_state_dict(model)}, checkpoint_id=directory)


def load_fsdp2_dcp(directory: str, model: nn.Module) -> None:
    """Load ``{"model": ...}`` from a DCP checkpoint (torch FSDP2's, or :func:`save_fsdp2_dcp`'s) into our
    ``fully_shard`` model, in place; each rank reads only the chunks that overlap its rows; collective."""
    dcp.load({"model": fsdp2_state_dict(model)}, checkpoint_id=directory)  # DCP copies into the local rows
