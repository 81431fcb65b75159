"""Wrap-time and step-time checks: bad input becomes a clear error, never a hang or a silent mistake.

* every own parameter and buffer on one device (one flat parameter lives on one device);
* the same weights on every rank (a checksum per tensor, one MIN and one MAX all-reduce),
  or ``sync_module_states=True`` to broadcast rank 0's;
* an optimizer built before wrapping: a process-wide optimizer step pre-hook refuses
  parameters that FSDP flattened away (they no longer train);
* a module on a device the group's backend cannot send (CPU on a plain "nccl" group);
* a weight tied across units, and a ``transformer_auto_wrap_policy`` class that matches nothing.

Note (control tensors): the checksums are ours, not the module's, so they are made on
``collective_device(group, like=a module tensor)``: CPU on gloo or "cpu:gloo,cuda:nccl",
the module's GPU on a plain "nccl" group (which moves CUDA tensors only).  The result
comes back to CPU for the comparison in Python.  The helpers live in
``minifsdp.ddp.distributed`` (DDP needs them first); they are re-exported here.
"""

from __future__ import annotations

import functools
import hashlib
import warnings
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from minifsdp.comm.devices import backend_devices, check_backend_supports, collective_device
from minifsdp.fsdp.core.units import clean_name, is_unit

__all__ = ["check_one_device", "check_same_on_all_ranks", "broadcast_from_rank0", "install_optimizer_check",
           "backend_devices", "check_backend_supports", "collective_device", "check_ties_across_units",
           "check_layer_cls_matches", "FLATTENED", "Flattened"]

FLATTENED = "_minifsdp_flattened"  # the one attribute FSDP puts on an original parameter it took over


@dataclass
class Flattened:
    """Where an original parameter was flattened, and whether it still trains (``use_orig_params``)."""

    module: nn.Module
    name: str
    fqn: str
    still_trains: bool
    sharded: bool = True  # between uses its unit holds a 1-D piece of it (not NO_SHARD's whole tensor)
    replicas: int = 1  # ranks holding the same piece, whose gradients are averaged (NO_SHARD: every rank)


def check_same_on_all_ranks(groups, module, params, buffers) -> None:
    """Compare a checksum of every own parameter and buffer across ranks (a MIN and a MAX all-reduce)."""
    tensors = params + buffers
    if not tensors:
        return
    digests = torch.tensor([_digest(t) for t in tensors], dtype=torch.int64)
    for group in filter(None, (groups.shard, groups.replicate)):
        check_backend_supports(group, tensors, "FSDP")
        device = collective_device(group, like=tensors[0])
        lo, hi = digests.to(device, copy=True), digests.to(device, copy=True)
        dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=group)
        dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=group)
        bad = (lo.cpu() != hi.cpu()).nonzero().flatten().tolist()
        if bad:
            names = {id(t): n for n, t in list(module.named_parameters()) + list(module.named_buffers())}
            which = ", ".join(names.get(id(tensors[i]), "?") for i in bad[:5])
            raise RuntimeError(
                f"FSDP: the model differs across ranks at wrap time ({which}). Every rank must start from the "
                "same weights: build the model with the same seed on every rank, or pass "
                "sync_module_states=True to copy rank 0's parameters and buffers to all ranks."
            )


def broadcast_from_rank0(groups, tensors) -> None:
    """sync_module_states=True: every rank takes rank 0's parameters and buffers (replicate, then shard group)."""
    for group in filter(None, (groups.replicate, groups.shard)):
        check_backend_supports(group, tensors, "FSDP(sync_module_states=True)")
        src = dist.get_global_rank(group, 0)
        for t in tensors:
            with torch.no_grad():
                dist.broadcast(t.data, src=src, group=group)


def check_one_device(module: nn.Module, params, buffers) -> None:
    """One flat parameter lives on one device: refuse a module whose own tensors are spread over several."""
    devices = {}
    names = {id(t): n for n, t in list(module.named_parameters()) + list(module.named_buffers())}
    for t in params + buffers:
        devices.setdefault(t.device, names.get(id(t), "?"))
    if len(devices) > 1:
        where = ", ".join(f"{n} on {d}" for d, n in devices.items())
        raise ValueError(f"FSDP: the module's parameters/buffers sit on different devices ({where}); one flat "
                         "parameter lives on one device. Move the module first: module.to(device), or pass device_id=.")


def _digest(t: torch.Tensor) -> int:
    """A 56-bit checksum of the tensor's bytes; works for 0-dim tensors (BatchNorm's num_batches_tracked) too."""
    data = t.detach().cpu().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()
    return int.from_bytes(hashlib.blake2b(data, digest_size=7).digest(), "little")


_OPTIMIZER_CHECK = []


def install_optimizer_check() -> None:
    """Once per process: before any optimizer step, refuse parameters that FSDP has replaced."""
    if _OPTIMIZER_CHECK:
        return

    def check(optimizer, args, kwargs):
        for group in optimizer.param_groups:
            for p in group["params"]:
                mark = getattr(p, FLATTENED, None)
                if mark is not None and not mark.still_trains:
                    raise RuntimeError(
                        f"{type(optimizer).__name__} holds the parameter '{mark.fqn}' that FSDP has "
                        "flattened away: the optimizer was built before wrapping, so it would train nothing. "
                        "Build it after wrapping: torch.optim.X(fsdp_model.parameters(), ...)."
                    )

    _OPTIMIZER_CHECK.append(register_optimizer_step_pre_hook(check))


def check_layer_cls_matches(module: nn.Module, policy: Callable) -> None:
    """Warn when a ``transformer_auto_wrap_policy`` names a class that no module in ``module`` is.

    torch FSDP1 wraps nothing then, silently: the whole model becomes one unit, every
    parameter is gathered at once and nothing says why memory did not drop (a typo, or
    ``GPT2Block`` given to a BERT).  We wrap the same (nothing) and warn, naming the class.
    A name given as a string (as in accelerate's config files) is refused: ``isinstance``
    needs the class itself (torch fails there with a bare ``TypeError``).
    """
    if not isinstance(policy, functools.partial) or policy.func.__name__ != "transformer_auto_wrap_policy":
        return
    classes = policy.keywords.get("transformer_layer_cls") or ()
    for cls in classes:
        if not isinstance(cls, type):
            raise TypeError(f"transformer_auto_wrap_policy: transformer_layer_cls takes classes, got {cls!r}; "
                            "import the class (e.g. `from transformers.models.bert.modeling_bert import BertLayer`)")
    present = {type(m) for m in module.modules()}
    for cls in classes:
        if not any(issubclass(t, cls) for t in present):
            warnings.warn(f"FSDP: transformer_layer_cls {cls.__module__}.{cls.__qualname__} matches no module of "
                          f"{type(module).__name__}, so nothing is wrapped by it (torch FSDP1 does the same, "
                          "silently): check the class", stacklevel=4)


def _outside_units(module: nn.Module, prefix: str = ""):
    """(name, module) for ``module`` and every submodule not inside a unit."""
    if is_unit(module):
        return
    yield prefix, module
    for name, child in module.named_children():
        yield from _outside_units(child, f"{prefix}.{name}" if prefix else name)


def check_ties_across_units(module: nn.Module, use_orig_params: bool) -> None:
    """Before ``module`` becomes a unit: a parameter of its own that another unit already flattened.

    That is a weight tied across units (``lm_head`` wrapped on its own, ``tok_emb`` left
    here).  torch FSDP1 (``_init_utils._get_orig_params``, ``_flat_param.py``):

    * ``use_orig_params=False``: the other unit puts no mark on the parameter, so this
      unit flattens it again: two copies, equal at the start, each trained by its own
      use's gradient; the tie is broken, silently.  We do the same, and warn.
    * ``use_orig_params=True``: it is marked flattened, so this unit skips it and its
      module keeps the original, whose ``.data`` the other unit sets.  Sharded, that is the
      1-D piece of the shard between uses: torch fails at the forward (``'weight' must be
      2-D``); we refuse here, naming both and the fix.  NO_SHARD (one rank too, where
      every strategy is NO_SHARD) keeps the whole tensor, so it trains tied, as torch:
      this use's gradient lands in the original's ``.grad``, which the other unit's
      write-back folds into its flat gradient before its pre-backward, or, arriving
      after that unit's post-backward, is added into the view of its gradient.  On more
      than one rank that late part misses the all-reduce (torch's too): we warn.
    """
    names = {id(m): clean_name(n) for n, m in module.named_modules()}
    for prefix, m in _outside_units(module):
        for name, p in m._parameters.items():
            where = getattr(p, FLATTENED, None)
            if where is None:
                continue
            here = f"{prefix}.{name}" if prefix else name
            owner = names.get(id(where.module))
            there = f"{owner}.{where.name}" if owner else where.name
            fix = (f"wrap the modules that share it in one unit (do not wrap the module of '{there}' on its own), "
                   "or untie them")
            if use_orig_params and not where.sharded:
                if where.replicas > 1:
                    warnings.warn(
                        f"FSDP(use_orig_params=True, NO_SHARD): '{here}' is the same parameter as '{there}', which "
                        "another unit flattened; it trains tied, but a use whose gradient arrives after that unit's "
                        "all-reduce is not averaged across ranks (torch FSDP1 the same), so the replicas drift. "
                        f"To train it tied on every rank alike, {fix}.", stacklevel=3)
                continue
            if use_orig_params:
                raise ValueError(
                    f"FSDP(use_orig_params=True): '{here}' is the same parameter as '{there}', which another FSDP "
                    f"unit already flattened; a parameter tied across sharded units is not supported (torch FSDP1 "
                    f"fails at the forward with \"'weight' must be 2-D\"). To train it tied, {fix}."
                )
            warnings.warn(
                f"FSDP: '{here}' is the same parameter as '{there}', which a nested FSDP unit already flattened. "
                "As torch FSDP1 (use_orig_params=False), this unit flattens its own copy: the two start equal and "
                f"train apart (the tie is broken). To keep them tied, {fix}.", stacklevel=3)
