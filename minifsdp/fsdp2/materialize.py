"""Chapter 5: shards replaced after ``fully_shard`` (meta-device init, ``model.to(dtype)``), adopted at the root's
first forward, as torch's ``reset_sharded_param``.

A large model is often built on the meta device (no memory), sharded, and only then given memory::

    with torch.device("meta"):
        model = Transformer(cfg)
    for block in model.layers:
        fully_shard(block)
    fully_shard(model)
    model.to_empty(device="cpu")      # replaces every local tensor with fresh, uninitialized memory
    model.reset_parameters()          # fills it

``to_empty`` (or ``model.to(torch.float64)``) puts a *new* local tensor in each sharded parameter, so the storage
the core's all-gather reads (``FSDPParam.padded_local``) is no longer the one the optimizer will update.  At the
root's first forward (the core's ``on_lazy_init`` point, :mod:`minifsdp.fsdp2.core.plugin`), :class:`Materialize`
adopts the new tensor: pads it again if needed, makes it the gathered storage, and swaps it into the same
parameter object (``torch.utils.swap_tensors``), so an optimizer made before still holds it.  Parameters still on
the meta device are refused then, with torch's message and the fix.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from minifsdp.fsdp2.core import FSDPParam, Plugin

__all__ = ["Materialize", "reset_sharded_param"]


def reset_sharded_param(p: FSDPParam) -> None:
    """Adopt a local tensor someone put in place of ours; a no-op when nothing was replaced."""
    module, name = p.users[0]
    current = module._parameters.get(name)
    if current is None or current is p.unsharded_param:
        return
    p.sharded_param = current
    # the raw local tensor, as torch's reset_sharded_param reads it: to_local() is an autograd op, and a first
    # forward inside a functorch transform (torch.func.jvp) would hand back a wrapper with no storage
    local = current._local_tensor if isinstance(current, DTensor) else current.data
    plain = type(local) is torch.Tensor and type(p.padded_local) is torch.Tensor  # a subclass has no storage
    if local.is_meta or (plain and local.untyped_storage().data_ptr() != 0 and
                         local.untyped_storage().data_ptr() == p.padded_local.untyped_storage().data_ptr()):
        return
    if tuple(local.shape) == tuple(p.padded_size):
        padded = local  # nothing to pad: the new local tensor is the storage
    else:
        if tuple(local.shape) != tuple(p.local_size):
            raise RuntimeError(f"fully_shard: {name} now holds local rows of shape {tuple(local.shape)}, not "
                               f"this rank's {tuple(p.local_size)}")
        padded = local.new_zeros(p.padded_size)
        p.local_view(padded).copy_(local)
        fresh = nn.Parameter(p.to_sharded_dtensor(p.local_view(padded)), current.requires_grad)
        torch.utils.swap_tensors(current, fresh)
    p.padded_local = padded
    p.orig_dtype = padded.dtype
    p.init_dtypes()
    p.full_padded, p.unsharded_param = None, None  # made again in the new dtype / device at the next gather
    p.install(p.sharded_param)


class Materialize(Plugin):
    """The plugin: at the root's first forward, adopt every replaced shard, then refuse what is still on meta."""

    def on_lazy_init(self, group) -> None:
        for p in group.fsdp_params:
            reset_sharded_param(p)
        on_meta = [p.fqn for p in group.fsdp_params if p.padded_local.is_meta]
        if on_meta:
            raise RuntimeError("FSDP parameters should be materialized from meta device before training, but the "
                               f"following were still on meta device: {on_meta}\nFor example, call "
                               "module.to_empty(device) to materialize to device and call module.reset_parameters() "
                               "on each module to initialize values.")
