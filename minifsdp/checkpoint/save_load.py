"""Checkpoints (chapter 4.3): save a sharded model and its optimizer, load them at any world size.

After ``from minifsdp import checkpoint`` and ``from minifsdp.checkpoint import resume``:

    checkpoint.save("run/step_10", model, opt, extra={"step": 10, "rng": resume.capture_rng()})
    extra = checkpoint.load("run/step_10", model, opt)          # every rank calls both (collective)

Two kinds (``full=`` on :func:`save`):

    sharded (default)  every rank writes its own pieces, in parallel; nothing is gathered.
                       run/step_10/rank00000.pt  rank00001.pt ...  manifest.json
    full               all-gathered to rank 0, one file: a plain state dict the unsharded
                       model (or torch FSDP1) loads directly: torch.load(...)["model"].
                       run/step_10/full.pt  manifest.json

Either kind loads into any layout: another world size, another sharding
strategy, ``use_orig_params``, or the plain ``nn.Module`` (see the pieces in
``pieces.py``).  Files are written atomically with a checksummed manifest
(``files.py``).  The source's ``save_checkpoint`` calls
``torch.save(model.state_dict())`` on rank 0: under FSDP that saves rank 0's
flat shard under a flat name, and no optimizer state that any other layout can
read.

Note (collective): every rank must call :func:`save` and :func:`load`; an error
on one rank (a missing file, a checksum) is raised on every rank, so none is
left waiting.  Note (trust): files are pickles (``extra`` may hold anything):
load only checkpoints you trust.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.nn as nn

from minifsdp.checkpoint.files import (
    CheckpointError,
    begin_directory,
    commit_directory,
    read_manifest,
    save_object,
    verify_file,
    write_manifest,
)
from minifsdp.checkpoint.files import rank_file as _rank_file
from minifsdp.checkpoint.pieces import PieceReader, piece_table
from minifsdp.checkpoint.state_dicts import (
    all_gather_object,
    full_optim_state_dict,
    full_state_dict,
    load_optimizer_from,
    load_param_groups,
    rank_and_world,
    sharded_state_dict,
)
from minifsdp.fsdp.core.units import units_with_params

__all__ = ["save", "load", "FULL_FILE"]

FULL_FILE = "full.pt"


def _agree(fn, group=None):
    """Run ``fn`` on every rank; if it raised anywhere, raise the same CheckpointError everywhere."""
    try:
        value, err = fn(), None
    except Exception as e:  # noqa: BLE001 - reported below, on every rank
        value, err = None, f"{type(e).__name__}: {e}" if not isinstance(e, CheckpointError) else str(e)
    errors = all_gather_object(err, group)
    bad = [(r, e) for r, e in enumerate(errors) if e is not None]
    if bad:
        first = bad[0][1] if len(errors) == 1 else f"rank {bad[0][0]}: {bad[0][1]}"
        raise CheckpointError(first if len(bad) == 1 else f"{first}\n(and {len(bad) - 1} more rank(s) failed)")
    return value


def save(directory: str, model: nn.Module, optimizer=None, extra=None, full: bool = False,
         overwrite: bool = False, group=None) -> None:
    """Write a checkpoint of ``model`` (and ``optimizer``) to ``directory``; collective.

    Args:
        extra: anything picklable, per rank (step, RNG states, data position);
            :func:`load` returns this rank's.
        full: gather to rank 0 and write one plain state dict, instead of one file per rank.
        overwrite: replace a complete checkpoint already at ``directory`` (after the new one is complete).
        group: the ranks the model is sharded over and that call ``save`` (default: all).
    """
    rank, world = rank_and_world(group)
    tmp = directory.rstrip("/") + ".tmp"
    _agree(lambda: begin_directory(directory, overwrite) if rank == 0 else None, group)
    extras = all_gather_object(extra, group)
    table = piece_table(model, optimizer)  # one walk of the model: every part of the save below reads it
    specs, tied, buffers = table.specs, table.tied, table.buffers

    def write():
        if full:  # every rank takes part in the gathers; rank 0 writes
            msd = full_state_dict(model, rank0_only=True)
            osd = full_optim_state_dict(model, optimizer, group=group, table=table) if optimizer is not None else None
            if rank != 0:
                return {}
            info = save_object(os.path.join(tmp, FULL_FILE), {"model": msd, "optim": osd, "extra": extras})
            info["pieces"] = {f: [0, int(torch.Size(s["shape"]).numel())] for f, s in specs.items()}
            return {FULL_FILE: info}
        sd = sharded_state_dict(model, optimizer, table=table)
        payload = {"model": sd["model"], "optim": sd["optim"] if optimizer is not None else None}
        if rank == 0:
            payload["model"].update({k: v.detach().clone() for k, v in buffers.items()})
            payload["extra"] = extras
        info = save_object(os.path.join(tmp, _rank_file(rank)), payload)
        info["pieces"] = sd["pieces"]
        return {_rank_file(rank): info}

    files = {}
    for part in all_gather_object(_agree(write, group), group):  # after this, every rank's file is on disk
        files.update(part)

    def commit():
        if rank != 0:
            return
        write_manifest(tmp, {"kind": "full" if full else "sharded", "world_size": world,
                             "main_file": FULL_FILE if full else _rank_file(0), "params": specs, "tied": tied,
                             "buffers": sorted(buffers), "has_optimizer": optimizer is not None,
                             "units": list(table.units), "torch_version": torch.__version__, "files": files})
        commit_directory(tmp, directory)

    _agree(commit, group)  # the rename is done before any rank returns


def load(directory: str, model: nn.Module, optimizer=None, reshard: bool = True, group=None):
    """Load a checkpoint written by :func:`save` (any kind, any world size); returns this rank's ``extra``.

    ``reshard=False`` refuses a checkpoint written at another world size.
    ``extra`` is this rank's own when the world size is the same, else rank 0's.
    ``group``: the ranks that call ``load`` (default: all).
    """
    rank, world = rank_and_world(group)
    table = piece_table(model)
    my_holders = table.my_holders
    cache: dict[str, dict] = {}  # file name -> its loaded dict: each file read at most once

    def open_file(name):
        if name not in cache:
            cache[name] = torch.load(os.path.join(directory, name), map_location="cpu", weights_only=False)
        return cache[name]

    def reader_for(manifest) -> PieceReader:
        return PieceReader({n: info["pieces"] for n, info in manifest["files"].items()}, open_file)

    def check():
        manifest = read_manifest(directory)
        where = os.path.join(directory, "manifest.json")
        if not reshard and manifest["world_size"] != world:
            raise CheckpointError(f"{where}: written by {manifest['world_size']} ranks, loading on {world} with "
                                  "reshard=False; pass reshard=True to re-cut the shards")
        specs = table.specs
        saved = manifest["params"]
        missing, unexpected = sorted(set(specs) - set(saved)), sorted(set(saved) - set(specs))
        shapes = [f"{f}: checkpoint {saved[f]['shape']} vs model {s['shape']}" for f, s in specs.items()
                  if f in saved and saved[f]["shape"] != s["shape"]]
        if missing or unexpected or shapes:
            raise CheckpointError(f"{where}: wrong model: not in the checkpoint {missing[:5]}, not in the model "
                                  f"{unexpected[:5]}, shape differs {shapes[:5]}")
        if optimizer is not None and not manifest["has_optimizer"]:
            raise CheckpointError(f"{where}: saved without an optimizer; load with optimizer=None")
        needed = {manifest["main_file"]}  # and every file with a piece this rank reads: verify those only
        reader = reader_for(manifest)
        for h in my_holders:
            for p in h.pieces:
                needed.update(fname for fname, *_ in reader.sources(p.fqn, p.lo, p.hi))
        for name in sorted(needed):
            verify_file(directory, name, manifest)
        return manifest

    manifest = _agree(check, group)

    def read():
        reader = reader_for(manifest)
        for unit in units_with_params(model):  # a full buffer kept since its gather would not see the shards
            unit._handle.end_use(free=True)    # written below (through .data, no version bump): drop it
        with torch.no_grad():
            for h in my_holders:
                flat = h.tensor.data.view(-1)
                for p in h.pieces:
                    if not reader.fill(flat[p.src_lo : p.src_hi], p.fqn, p.lo, p.hi, lambda f, q: f["model"].get(q)):
                        raise CheckpointError(f"{directory}: no file holds {p.fqn}[{p.lo}:{p.hi}]")
            main = open_file(manifest["main_file"])
            for name, buf in table.buffers.items():
                if name in main["model"]:
                    buf.copy_(main["model"][name])
            if optimizer is not None:
                load_optimizer_from(reader, model, optimizer, table)
                load_param_groups(optimizer, main["optim"]["param_groups"], directory)
        extras = main["extra"]
        return extras[rank] if len(extras) == world else extras[0]

    extra = _agree(read, group)
    if dist.is_initialized():
        dist.barrier(group)
    return extra
