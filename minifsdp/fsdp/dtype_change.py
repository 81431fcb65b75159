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
parameter's dtype at that moment; so do we (``adopt_dtype``, ``torch_extension.py``):

    FSDP(model); model.half(); model(x.half())         works: the unit computes in float16
    FSDP(model); model(x); model.half(); model(x)      refused at the all-gather (torch's ValueError:
                                                       "Invalid usage of tensors with different dtypes")

``MixedPrecision`` resolves its dtypes against the new one (``core/mixed_precision.resolve_dtypes``).
"""

from __future__ import annotations

import contextlib

__all__ = ["flat_param_registered"]


@contextlib.contextmanager
def flat_param_registered(unit, orig_params):
    """While ``nn.Module._apply`` runs: the unit's wrapped module registers the flat parameter as
    ``_flat_param`` and the originals are unregistered; on exit the registrations are as before and the
    originals are views of the (converted) shard again (``orig_params``: the unit's ``OrigParams``)."""
    handle, module = unit._handle, unit.module
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
        orig_params.use_sharded_views(unit)  # the originals' .data: views of the shard in its new dtype
