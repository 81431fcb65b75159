"""Checkpoint files that lose nothing: atomic writes and a manifest with checksums.

A checkpoint is a directory.  Every rank writes its own file; rank 0 writes the
manifest last, and only then does the directory get its final name:

    run/
      step_00000004/            a complete checkpoint (it has a manifest)
        manifest.json           format, version, world size, layout, one sha256 per file
        rank00000.pt            rank 0's pieces (+ buffers, + every rank's `extra`)
        rank00001.pt            rank 1's pieces
      step_00000006.tmp/        a save that crashed half-way: no manifest, never loaded,
                                removed by the next save to the same name

    save:  every rank writes into <name>.tmp/ --all done--> rank 0: manifest.json, fsync, rename to <name>
    file:  write <file>.partial, flush, fsync, rename to <file>, fsync the directory

Note (atomic rename): ``os.replace`` of a file or an empty-target directory on
one filesystem is atomic on POSIX: a reader sees the old name or the new one,
never half a file.  The fsyncs make sure the bytes reach the disk *before* the
rename does, so a power cut cannot leave a complete-looking name over missing
bytes.  (Many nodes: the directory must be on a filesystem every rank sees.)

Note (what counts as a checkpoint): a directory with a ``manifest.json`` whose
files all exist with the recorded size and sha256.  Anything else is refused
with an error that names the file and the problem; a save never deletes or
overwrites a complete checkpoint unless asked to (``overwrite=True``, or the
``keep`` rotation of ``manager.CheckpointManager``, which removes only the oldest
complete ones and only after the new one is complete).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil

import torch
import torch.distributed as dist

__all__ = ["FORMAT", "VERSION", "CheckpointError", "atomic_write_bytes", "save_object", "sha256_file",
           "write_manifest", "read_manifest", "verify_file", "rank_file", "is_complete", "begin_directory",
           "commit_directory", "barrier", "rank_of"]

FORMAT = "minifsdp-checkpoint"
VERSION = 1
MANIFEST = "manifest.json"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be loaded as asked: the message names the file and the problem."""


def rank_file(rank: int) -> str:
    return f"rank{rank:05d}.pt"


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # some platforms cannot open directories; the rename is still atomic
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write_bytes(path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` so that ``path`` is either absent, the old file, or all of ``data``."""
    tmp = path + ".partial"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(os.path.dirname(os.path.abspath(path)))


def save_object(path: str, obj) -> dict:
    """``torch.save`` into memory, then :func:`atomic_write_bytes`; returns {bytes, sha256}."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    data = buf.getvalue()
    atomic_write_bytes(path, data)
    return {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def write_manifest(directory: str, manifest: dict) -> None:
    manifest = {"format": FORMAT, "version": VERSION, **manifest}
    atomic_write_bytes(os.path.join(directory, MANIFEST), json.dumps(manifest, indent=1).encode())


def read_manifest(directory: str) -> dict:
    """The manifest, checked for format and version; clear errors for anything else."""
    if not os.path.isdir(directory):
        raise CheckpointError(f"{directory}: no such checkpoint directory")
    path = os.path.join(directory, MANIFEST)
    if not os.path.exists(path):
        hint = " (a save that did not finish: its .tmp directory is not a checkpoint)" if directory.endswith(
            ".tmp") else " (the save that wrote it did not finish, or this is not a minifsdp checkpoint)"
        raise CheckpointError(f"{path}: missing{hint}; load an earlier checkpoint")
    try:
        with open(path) as f:
            manifest = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: unreadable or corrupted manifest ({e})") from None
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not a minifsdp checkpoint (format {manifest.get('format')!r})")
    if manifest.get("version") != VERSION:
        raise CheckpointError(f"{path}: format version {manifest.get('version')} but this minifsdp reads "
                              f"version {VERSION}; convert it or use the minifsdp that wrote it")
    return manifest


def verify_file(directory: str, name: str, manifest: dict) -> str:
    """Check one data file against the manifest (exists, size, sha256); returns its path."""
    path = os.path.join(directory, name)
    info = manifest["files"].get(name)
    if info is None:
        raise CheckpointError(f"{path}: not listed in the manifest")
    if not os.path.exists(path):
        raise CheckpointError(f"{path}: missing (the manifest lists it: a rank file was deleted or never copied)")
    size = os.path.getsize(path)
    if size != info["bytes"]:
        raise CheckpointError(f"{path}: truncated or padded: {size} bytes, the manifest says {info['bytes']}")
    if sha256_file(path) != info["sha256"]:
        raise CheckpointError(f"{path}: corrupted: its sha256 differs from the manifest's")
    return path


def is_complete(directory: str) -> bool:
    return os.path.isdir(directory) and os.path.exists(os.path.join(directory, MANIFEST))


def begin_directory(directory: str, overwrite: bool) -> str:
    """Rank 0, before a save: refuse to clobber, clear a stale ``.tmp``, create it; returns the tmp path."""
    if is_complete(directory) and not overwrite:
        raise FileExistsError(f"{directory}: a complete checkpoint is already there; pass overwrite=True "
                              "or save under another name (CheckpointManager numbers them by step)")
    tmp = directory.rstrip("/") + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    return tmp


def commit_directory(tmp: str, directory: str) -> None:
    """Rank 0, after the manifest: the atomic rename that makes the checkpoint exist."""
    old = None
    if os.path.exists(directory):  # overwrite=True: move the old one aside first, delete it last
        old = directory.rstrip("/") + ".old"
        shutil.rmtree(old, ignore_errors=True)
        os.replace(directory, old)
    os.replace(tmp, directory)
    _fsync_dir(os.path.dirname(os.path.abspath(directory)))
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def barrier(group) -> None:
    """Wait for every rank of ``group`` (nothing to wait for outside a distributed run)."""
    if dist.is_initialized():
        dist.barrier(group)


def rank_of(group) -> int:
    return dist.get_rank(group) if dist.is_initialized() else 0
