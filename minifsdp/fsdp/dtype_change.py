"""``model.half()`` / ``.to(torch.float16)`` / ``.double()`` after wrapping, as torch FSDP1 handles it.

All three are ``nn.Module._apply(fn)``: ``fn`` is applied to every *registered* parameter,
swapping its ``.data`` (the parameter object stays).  What that reaches under FSDP:

    use_orig_params=False   the unit's flat parameter (registered as ``_flat_param``): its shard is
                            converted, the original names are plain tensors and are left alone
    use_orig_params=True    the originals are registered, and are views of the shard: converting
                            them would cut them loose.  So, as torch's ``FSDP._apply``, the unit
                            registers its flat parameter in their place meanwhile
                            (:func:`flat_param_registered`), and afterwards points them at the
                            converted shard again

Then the buffers the unit gathers into (and its gradient leaf) are still in the old dtype.
torch FSDP1 allocates them at its lazy init, the root's first forward, from the flat
parameter's dtype at that moment; so do we (:func:`adopt_dtype`):

    FSDP(model); model.half(); model(x.half())         works: the unit computes in float16
    FSDP(model); model(x); model.half(); model(x)      refused at the all-gather (torch's ValueError:
                                                       "Invalid usage of tensors with different dtypes")

``MixedPrecision`` resolves its dtypes against the new one (``MixedPrecision.dtypes_for``).
"""

from __future__ import annotations

import contextlib

import torch

from minifsdp.fsdp.state import HandleState

__all__ = ["flat_param_registered", "adopt_dtype", "check_dtype"]


@contextlib.contextmanager
def flat_param_registered(handle, module: torch.nn.Module):
    """While ``nn.Module._apply`` runs: ``module`` (the unit's wrapped module) registers the flat parameter
    as ``_flat_param`` and the originals are unregistered; on exit the registrations are as before and
    the originals are views of the (converted) shard again."""
    owners = []  # (module, its _parameters as they were): restored as is, order included
    for slot in handle.layout.slots + handle.layout.shared:
        if all(m is not slot.module for m, _ in owners):
            owners.append((slot.module, dict(slot.module._parameters)))
    for slot in handle.layout.slots + handle.layout.shared:
        slot.module._parameters.pop(slot.name, None)
    module._parameters["_flat_param"] = handle.flat_param
    try:
        yield
    finally:
        del module._parameters["_flat_param"]
        for m, params in owners:
            m._parameters.clear()
            m._parameters.update(params)
        handle.use_sharded_views()  # the originals' .data: views of the shard in its new dtype


def adopt_dtype(handle) -> None:
    """Before the root's first forward: build the unit's dtypes and gather buffers from the flat
    parameter's dtype now (it changed if ``model.half()`` ran since wrapping); the buffer must be freed."""
    new = handle.flat_param.dtype
    if new == handle.orig_dtype or (handle.frees and handle.state is not HandleState.SHARDED):
        return
    mp = handle.mixed_precision
    handle.orig_dtype = new
    handle.param_dtype, handle.reduce_dtype = mp.dtypes_for(new) if mp is not None else (new, new)
    handle.uses_param_mp = handle.param_dtype != new
    keep_low = mp is not None and mp.keep_low_precision_grads
    handle.grad_dtype = handle.param_dtype if keep_low else new
    if handle.frees:
        handle.padded = torch.empty(handle.layout.padded_numel, dtype=handle.param_dtype,
                                    device=handle.flat_param.device)
        handle.unsharded.data = handle.padded[: handle.layout.numel]  # the same leaf: its hook stays
        handle.padded.untyped_storage().resize_(0)


def check_dtype(handle) -> None:
    """After the root's first forward: a flat parameter converted since cannot be gathered (torch's error)."""
    if handle.flat_param.dtype != handle.orig_dtype:
        raise ValueError(
            f"Invalid usage of tensors with different dtypes: FSDP unit {handle.name!r} was set up for "
            f"{handle.orig_dtype} at its first forward, and its sharded parameters are {handle.flat_param.dtype} "
            "now (model.half() / .to(dtype) / .double() after the first forward; torch FSDP1 raises this "
            "ValueError too). Convert the model before its first forward, or compute in a lower precision "
            "with mixed_precision=MixedPrecision(param_dtype=...)."
        )
