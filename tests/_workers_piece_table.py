"""Count how one checkpoint save walks the model: calls into the piece map, and checkpoint <-> fsdp crossings.

A *walk* is one call, from outside ``minifsdp/fsdp/param_pieces.py``, of a function there that goes over
the whole model (``module_names``, ``holders``, ``piece_table``), or one call of ``units_with_params`` made
directly from ``minifsdp/checkpoint/`` or ``minifsdp/fsdp/optim_state.py`` (each walks every module again).
A *crossing* is a Python call whose caller lives in ``minifsdp/checkpoint/`` and whose callee lives in
``minifsdp/fsdp/``, or the other way round.  Both are counted with ``sys.setprofile`` on the calling rank:

    with SaveWalks() as counter:
        checkpoint.save(...)
    counter.walks, counter.crossings, counter.calls   # calls: {"param_pieces.holders": 3, ...}
    counter.crossing_sites                           # {(caller, callee)}: the distinct climbs

``piece_table_worker`` is the rank function of ``tests/test_piece_table.py`` (the table against torch
FSDP1's shard metadata, and one walk per save); ``save_walks_worker`` prints the whole count of one save
per layout (walks, crossings, the distinct climbs), the measurement to repeat after a change to the save.
"""

from __future__ import annotations

import os
import sys
from collections import Counter

import torch

import minifsdp
from minifsdp.fsdp.core.units import clean_name

_ROOT = os.path.dirname(os.path.abspath(minifsdp.__file__))
_CKPT = os.path.join(_ROOT, "checkpoint") + os.sep
_FSDP = os.path.join(_ROOT, "fsdp") + os.sep
_PIECES = os.path.join(_ROOT, "fsdp", "param_pieces.py")
_OPTIM = os.path.join(_ROOT, "fsdp", "optim_state.py")
_UNITS = os.path.join(_ROOT, "fsdp", "core", "units.py")
_WALKERS = {"module_names", "holders", "piece_table"}


def _side(filename: str) -> str | None:
    if filename.startswith(_CKPT):
        return "checkpoint"
    if filename.startswith(_FSDP):
        return "fsdp"
    return None


class SaveWalks:
    """A context manager: counts walks of the model and checkpoint<->fsdp crossings while it is open."""

    def __init__(self):
        self.walks, self.crossings, self.calls = 0, 0, Counter()
        self.crossing_sites: set[tuple[str, str]] = set()  # (caller, callee) function names: distinct climbs

    def _profile(self, frame, event, arg):
        if event != "call":
            return
        callee, caller = frame.f_code, frame.f_back.f_code if frame.f_back is not None else None
        if caller is None:
            return
        a, b = _side(caller.co_filename), _side(callee.co_filename)
        if a and b and a != b:
            self.crossings += 1
            self.crossing_sites.add((f"{os.path.basename(caller.co_filename)}:{caller.co_name}",
                                     f"{os.path.basename(callee.co_filename)}:{callee.co_name}"))
        name = callee.co_name
        if callee.co_filename == _PIECES and name in _WALKERS and caller.co_filename != _PIECES:
            self.walks += 1
            self.calls[f"param_pieces.{name}"] += 1
        elif callee.co_filename == _UNITS and name == "units_with_params" and (
                caller.co_filename.startswith(_CKPT) or caller.co_filename == _OPTIM):
            self.walks += 1
            self.calls[f"units_with_params from {os.path.basename(caller.co_filename)}"] += 1

    def __enter__(self):
        self._old = sys.getprofile()
        sys.setprofile(self._profile)
        return self

    def __exit__(self, *exc):
        sys.setprofile(self._old)
        return False


def torch_rows(model) -> list[tuple]:
    """torch FSDP1's own account of each original parameter on this rank, as our rows:
    ``(fqn, offset in the flat buffer, shape, lo, hi, src_lo, src_hi)``, from each ``FlatParameter``'s
    ``_numels_with_padding`` / ``_is_padding_mask`` (the offsets) and ``_shard_param_infos`` (the ranges)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP

    out = []
    for name, m in model.named_modules():
        if not isinstance(m, TorchFSDP) or m._handle is None:
            continue
        prefix = clean_name(name)
        fp, offset, j = m._handle.flat_param, 0, 0
        for numel, padding in zip(fp._numels_with_padding, fp._is_padding_mask, strict=True):
            if not padding:
                info, fqn = fp._shard_param_infos[j], fp._fqns[j]
                fqn = f"{prefix}.{fqn}" if prefix else fqn
                if info.in_shard:
                    lo, hi = info.intra_param_start_idx, info.intra_param_end_idx + 1  # torch's end is inclusive
                    src_lo, src_hi = info.offset_in_shard, info.offset_in_shard + info.numel_in_shard
                else:
                    lo = hi = src_lo = src_hi = 0
                out.append((fqn, offset, tuple(fp._shapes[j]), lo, hi, src_lo, src_hi))
                j += 1
            offset += numel
    return out


def piece_table_worker(tmp: str) -> dict:
    """Rank function: our piece table against torch FSDP1's shard metadata, and the walks of one save."""
    import functools

    import torch.distributed as dist
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy as torch_policy

    from minifsdp import checkpoint
    from minifsdp.fsdp.param_pieces import piece_table
    from minifsdp.models import Block, TinyGPT
    from tests._workers_checkpoint import make_opt, ours, step

    out = {"rank": dist.get_rank()}
    for orig in (False, True):
        a = ours(use_orig_params=orig)
        b = TorchFSDP(TinyGPT(seed=0), auto_wrap_policy=functools.partial(torch_policy, transformer_layer_cls={Block}),
                      device_id=torch.device("cpu"), use_orig_params=orig)
        opt = make_opt("adamw", a)
        step(a, opt, 0)
        table = piece_table(a, opt)
        mine = [(r.fqn, r.offset, r.shape, r.lo, r.hi, r.src_lo, r.src_hi) for r in table.rows if r.unit >= 0]
        out[f"orig={orig} rows"], out[f"orig={orig} torch rows"] = mine, torch_rows(b)
        # each row's numbers of its holder are its numbers of the parameter: the holder's tensor, sliced
        full = checkpoint.full_state_dict(a)
        out[f"orig={orig} row numbers wrong"] = [
            r.fqn for r in table.rows
            if not torch.equal(table.all_holders[r.holder].tensor.detach().reshape(-1)[
                (r.src_lo if not orig else 0):(r.src_hi if not orig else r.hi - r.lo)],
                full[r.fqn].reshape(-1)[r.lo:r.hi])]
        out[f"orig={orig} optim keys"] = sorted({r.optim_keys for r in table.rows if r.held})
        for full_save in (False, True):
            dist.barrier()
            with SaveWalks() as counter:
                checkpoint.save(os.path.join(tmp, f"orig={orig}-full={full_save}"), a, opt, full=full_save)
            out[f"orig={orig} full={full_save} walks"] = (counter.walks, dict(counter.calls))
    return out


def save_walks_worker(tmp: str) -> dict:
    """Rank function: count one sharded and one full save of a trained TinyGPT (AdamW, 2 steps), per layout."""
    import torch.distributed as dist

    from minifsdp import checkpoint
    from tests._workers_checkpoint import make_opt, ours, step

    out = {}
    for orig in (False, True):
        model = ours(use_orig_params=orig)
        opt = make_opt("adamw", model)
        for i in range(2):
            step(model, opt, i)
        for full in (False, True):
            name = f"{'orig' if orig else 'flat'}-{'full' if full else 'sharded'}"
            dist.barrier()
            with SaveWalks() as counter:
                checkpoint.save(os.path.join(tmp, name), model, opt, extra={"step": 2}, full=full)
            out[name] = {"walks": counter.walks, "crossings": counter.crossings,
                         "crossing_sites": sorted(map(list, counter.crossing_sites)), "calls": dict(counter.calls)}
    out["rank"] = dist.get_rank()
    out["torch"] = torch.__version__
    return out
