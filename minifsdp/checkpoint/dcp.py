"""Interop with ``torch.distributed.checkpoint`` (DCP), the format torch FSDP2 checkpoints are written in.

    torch FSDP2 run                                   minifsdp run
    sd = get_state_dict(model, optim)                 save_dcp(dir, model, optim)
    dcp.save({"model": .., "optim": ..}, dir)  --->   load_dcp(dir, model, optim)
                                               <---

DCP stores every tensor as *chunks*: boxes of an N-d tensor (FSDP2 shards dim 0,
so a chunk is a block of rows).  Our shards are ranges of flattened numbers,
which are not boxes in general, so we meet DCP at the full tensors:

* :func:`load_dcp`: every rank asks DCP for whole tensors (DCP reads the
  overlapping chunks and stitches them), then keeps its pieces.
* :func:`save_dcp`: whole tensors on every rank; DCP writes each replicated
  tensor once (its "dedup" gives each to one rank), so a torch FSDP2 run can load
  it into its row shards.

Note (cost): both directions hold one whole model (and optimizer state) per rank for
a moment, as a full state dict does.  A production version would describe each
flat-shard piece that is a run of whole rows as a DCP chunk; this one is meant to
be read, not to checkpoint a model that does not fit in one process.  Works on
CPU/gloo with torch 2.13 (tested in ``tests/test_checkpoint.py``).

Names: ``"model.<fqn>"`` and ``"optim.state.<fqn>.<key>"``, ``"optim.param_groups"``:
the layout of ``torch.distributed.checkpoint.state_dict.get_state_dict``.
"""

from __future__ import annotations

import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from minifsdp.checkpoint.pieces import param_specs, persistent_buffers
from minifsdp.checkpoint.state_dicts import full_optim_state_dict, full_state_dict, load_full_optim_state_dict

__all__ = ["save_dcp", "load_dcp"]


def save_dcp(directory: str, model: nn.Module, optimizer=None) -> None:
    """Write ``model`` (and ``optimizer``) in DCP format, names as torch's ``get_state_dict``; collective."""
    state = {"model": dict(full_state_dict(model))}
    if optimizer is not None:
        state["optim"] = full_optim_state_dict(model, optimizer, rank0_only=False)
    dcp.save(state, checkpoint_id=directory)


def _set(root: dict, path: tuple, value) -> None:
    """root[path[0]][path[1]]... = value, creating dicts (str keys) and lists (int keys) on the way."""
    cur = root
    for key, nxt in zip(path[:-1], path[1:]):
        empty = {} if isinstance(nxt, str) else []
        if isinstance(cur, list):
            cur.extend([None] * (key + 1 - len(cur)))
            cur[key] = cur[key] if cur[key] is not None else empty
        else:
            cur.setdefault(key, empty)
        cur = cur[key]
    if isinstance(cur, list):
        cur.extend([None] * (path[-1] + 1 - len(cur)))
    cur[path[-1]] = value


def _template(directory: str) -> dict:
    """An empty state dict shaped like the checkpoint: full-size tensors, placeholders for the rest."""
    md = dcp.FileSystemReader(directory).read_metadata()
    paths = md.planner_data or {k: tuple(k.split(".", 1)) for k in md.state_dict_metadata}
    template: dict = {}
    for key, meta in md.state_dict_metadata.items():
        if isinstance(meta, TensorStorageMetadata):
            value = torch.zeros(meta.size, dtype=meta.properties.dtype)
        else:
            value = None  # bytes (python objects, param_groups): DCP puts the saved object here
        _set(template, tuple(paths.get(key, (key,))), value)
    return template


def load_dcp(directory: str, model: nn.Module, optimizer=None) -> None:
    """Load a DCP checkpoint (torch FSDP2's or :func:`save_dcp`'s) into any minifsdp layout; collective."""
    state = _template(directory)
    if "model" not in state:
        raise RuntimeError(f"{directory}: no 'model' entry in this DCP checkpoint; save it as "
                           "dcp.save({'model': get_model_state_dict(model), ...}) (top-level keys: "
                           f"{sorted(state)})")
    dcp.load(state, checkpoint_id=directory)
    specs, tied = param_specs(model)
    saved = state["model"]
    missing = sorted(k for k in list(specs) + list(persistent_buffers(model)) if k not in saved)
    if missing:
        raise RuntimeError(f"{directory}: DCP checkpoint lacks {missing[:5]}; is it the same model?")
    model_sd = {k: saved[k] for k in list(specs) + list(persistent_buffers(model))}
    for alias, owner in tied.items():
        model_sd.setdefault(alias, model_sd[owner])
    model.load_state_dict(model_sd)
    if optimizer is not None:
        if "optim" not in state:
            raise RuntimeError(f"{directory}: this DCP checkpoint has no 'optim' entry; load with optimizer=None")
        load_full_optim_state_dict(model, optimizer, state["optim"])

