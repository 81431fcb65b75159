"""Chapter 5: all-gather extensions, torch FSDP2's two hooks for parameters that are not plain tensors.

A plain parameter is gathered as it is stored: each rank sends its padded rows, the full weight is the N rows
put side by side (:mod:`minifsdp.fsdp2.core.collectives`).  A quantized weight (int8 or fp8 data plus a scale), a
weight kept as two tensors, or a weight one wants to send in bf16 but compute in fp32 needs something else: send
*other* tensors, maybe several, maybe of other dtypes, and build the full weight from what arrives.  torch lets the
parameter's local tensor (the DTensor's ``_local_tensor``: a tensor subclass, or a plain tensor with the two
methods patched onto it) say how, with two methods::

    fsdp_pre_all_gather(mesh, outer_size, outer_stride, module, mp_policy)    (older form: (mesh) alone)
        -> (all_gather_inputs: tuple of tensors, metadata)
    fsdp_post_all_gather(all_gather_outputs, metadata, param_dtype, *, out=None)
        -> (unsharded_tensor, inner_tensors_to_free), or None when ``out`` is given

``mesh`` is the shard mesh (1-D, also under HSDP), ``outer_size`` / ``outer_stride`` the whole weight's.  Each
output is its input gathered from the N ranks, shaped ``(N * rows, *rest)``.  The first gather calls the post
hook without ``out``; what it returns, cut to the weight's shape, becomes the unsharded parameter, made once as
for plain parameters (autograd keeps seeing the same object).  Later gathers call it with ``out=`` that
parameter, to be refilled in place.  At reshard the outputs and the inner tensors it named are freed (their
storages resized to 0 bytes), and allocated again before the next post hook.

One all-gather per group still.  Every parameter adds its inputs (a plain parameter: its padded rows) to one
buffer; if they do not all have one dtype, the buffer is bytes (``uint8``) and each input goes in as its bytes
-- what torch's ``foreach_all_gather`` does, so the collective is the same call on the same bytes.  A group with
w (an extension: data int8 and scale fp32) and a plain bias b, N = 2::

    one rank's row, in bytes:  [ w.data (int8) | w.scale (fp32 bytes) | b (fp32 bytes) ]
    all-gather:                | rank 0's row                        | rank 1's row                        |
    copy-out (view (N, total)):  w.data's columns of both rows -> w's output 0, (2 * numel) int8
                                 w.scale's columns              -> w's output 1, its bytes
                                 b's columns                    -> b's full buffer, as a plain parameter
    post hook: w.fsdp_post_all_gather((data (2*rows, cols), scale (2*rows, 1)), metadata, fp32) -> full w

Why above the core: the core's gather (one dtype, one input per parameter, copy-out into the full buffer) stays
as it reads; :class:`GatherExtensions` plugs in (:mod:`minifsdp.fsdp2.core.plugin`) where a group gathers
(``all_gather``: only when some parameter defines the hooks or the group mixes dtypes), reshards (``before_reshard``:
free the outputs) and is set up (``after_shard`` and again ``on_lazy_init``: find the hooks, also ones patched onto
the local tensors in between, as torch's).  Not built here, as in torch: an int ``reshard_after_forward`` with
extensions.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn as nn

from minifsdp.fsdp2.core import FSDPParam, Plugin
from minifsdp.fsdp2.core.param import alloc_storage, contiguous_stride, free_storage
from minifsdp.fsdp2.placement import copy_out_param

__all__ = ["GatherExtensions", "Extension", "GroupGather", "sharded_local"]


def sharded_local(p: FSDPParam) -> torch.Tensor:
    """The sharded parameter's local tensor object itself (where the hooks live; ``to_local()`` makes a new one)."""
    return getattr(p.sharded_param, "_local_tensor", p.sharded_param)


class Extension:
    """What one parameter's hooks need between calls: the metadata from pre to post, the inputs' shapes, the
    gathered outputs (allocated once, refilled every gather) and the inner tensors to free at reshard."""

    def __init__(self, shard_mesh):
        self.mesh = shard_mesh
        self.metadata = None
        self.input_sizes: list[torch.Size] = []
        self.outputs: list[torch.Tensor] = []  # one flat (N * numel,) tensor per input
        self.inner_tensors: list[torch.Tensor] = []

    def pre_all_gather(self, p: FSDPParam, mp_policy) -> list[torch.Tensor]:
        """Call the pre hook on the local tensor; its inputs, flat."""
        hook = sharded_local(p).fsdp_pre_all_gather
        n_args = len(inspect.signature(hook).parameters)
        if n_args == 1:  # the older form: the mesh alone
            inputs, self.metadata = hook(self.mesh)
        elif n_args == 5:
            inputs, self.metadata = hook(self.mesh, p.full_size, contiguous_stride(p.full_size), p.users[0][0],
                                         mp_policy)
            if tuple(p.local_size) != tuple(p.padded_size) and any(
                    tuple(t.size()) != tuple(p.padded_size) for t in inputs):
                raise AssertionError(
                    f"When a parameter is unevenly sharded by FSDP (orig size={p.full_size}, FSDP world size="
                    f"{p.world_size}), fsdp_pre_all_gather must return all-gather inputs with the padded sharded "
                    f"size {p.padded_size} but got {[t.size() for t in inputs]}")
        else:
            raise AssertionError(f"Invalid fsdp_pre_all_gather: {inspect.signature(hook)}\nExpects fsdp_pre_all_gather("
                                 "self, mesh: DeviceMesh, outer_size: torch.Size, outer_stride: tuple[int, ...], "
                                 "module: nn.Module, mp_policy: MixedPrecisionPolicy)")
        self.input_sizes = [t.size() for t in inputs]
        return [t.view(-1) for t in inputs]

    def alloc_outputs(self, inputs: list[tuple[int, torch.dtype]], world: int, device) -> list[torch.Tensor]:
        """The gathered outputs, made at the first gather (one per input ``(numel, dtype)``: N times its numel,
        its dtype), their storages allocated again after a free."""
        if not self.outputs:
            self.outputs = [torch.empty(world * numel, dtype=dtype, device=device) for numel, dtype in inputs]
        for t in self.outputs:
            alloc_storage(t)
        return self.outputs

    def post_all_gather(self, p: FSDPParam) -> None:
        """Build (first gather) or refill (``out=``, later gathers) ``p.unsharded_param`` from the outputs."""
        outputs = tuple(t.view(-1, *size[1:]) for t, size in zip(self.outputs, self.input_sizes, strict=True))
        hook = sharded_local(p).fsdp_post_all_gather
        dtype = p.param_dtype or p.orig_dtype
        if p.unsharded_param is not None:
            for t in self.inner_tensors:
                alloc_storage(t)
            hook(outputs, self.metadata, dtype, out=p.unsharded_param)
        else:
            full, inner = hook(outputs, self.metadata, dtype)
            self.inner_tensors = list(inner)
            # the full tensor may hold padding rows below the weight's: keep the weight's shape, as torch does
            full = torch.as_strided(full, p.full_size, contiguous_stride(p.full_size), storage_offset=0)
            p.unsharded_param = nn.Parameter(full, requires_grad=p.sharded_param.requires_grad)
        self.metadata = None

    def free(self) -> None:
        """At reshard: free the outputs and the inner tensors the post hook named."""
        for t in (*self.outputs, *self.inner_tensors):
            free_storage(t)


class GatherExtensions(Plugin):
    """The plugin: one :class:`Extension` per parameter whose local tensor defines the hooks."""

    def __init__(self):
        self.extensions: dict[FSDPParam, Extension] = {}

    def after_shard(self, group, originals) -> None:
        self._find(group)

    def on_lazy_init(self, group) -> None:
        self._find(group)

    def _find(self, group) -> None:
        """Give each parameter whose local tensor defines the hooks an :class:`Extension` (kept if it has one)."""
        for p in group.fsdp_params:
            local = sharded_local(p)
            pre, post = hasattr(local, "fsdp_pre_all_gather"), hasattr(local, "fsdp_post_all_gather")
            if pre != post:
                raise AssertionError("Both fsdp_pre_all_gather and fsdp_post_all_gather should be defined if using "
                                     f"all-gather extensions: {local}")
            if not pre or p.mesh is None:
                self.extensions.pop(p, None)
            elif p not in self.extensions:
                mesh = p.mesh if p.mesh.ndim == 1 else p.mesh[p.mesh.mesh_dim_names[-1]]
                self.extensions[p] = Extension(mesh)

    def all_gather(self, group):
        """This path only if some parameter has hooks or the parameters' dtypes differ (a byte buffer then)."""
        params = group.fsdp_params
        if not self.extensions and len({p.unsharded_dtype for p in params}) == 1:
            return None
        return GroupGather.start(params, self.extensions, group.mp_policy, group.comm, group.group,
                                 group.world_size, group.rank)

    def before_reshard(self, group) -> None:
        if group.is_unsharded:
            for ext in self.extensions.values():
                ext.free()


class GroupGather:
    """One group's all-gather through the extensions: several inputs per parameter, any dtypes.

    :meth:`start` runs the pre hooks, the copy-in and the collective; :meth:`copy_out` the outputs and the post
    hooks, as the core's gather splits ``unshard`` / ``wait_for_unshard``."""

    def __init__(self, params: list[FSDPParam], extensions: dict[FSDPParam, Extension],
                 inputs: list[list[tuple[int, torch.dtype]]], buffer: torch.Tensor, sizes: list[int], as_bytes: bool,
                 world: int):
        self.params, self.extensions, self.inputs, self.buffer, self.sizes = params, extensions, inputs, buffer, sizes
        self.as_bytes, self.world = as_bytes, world  # as_bytes: the inputs' dtypes differ, the buffer is uint8

    @classmethod
    @torch.no_grad()
    def start(cls, params: list[FSDPParam], extensions: dict[FSDPParam, Extension], mp_policy, comm, group,
              world: int, rank: int) -> GroupGather:
        inputs = [extensions[p].pre_all_gather(p, mp_policy) if p in extensions
                  else [p.all_gather_input().to(p.unsharded_dtype)] for p in params]
        flat = [t for ts in inputs for t in ts]
        as_bytes = any(t.dtype != flat[0].dtype for t in flat)
        if as_bytes:
            flat = [t.view(torch.uint8) for t in flat]
        sizes = [t.numel() for t in flat]
        total = sum(sizes)
        buffer = torch.empty(world * total, dtype=flat[0].dtype, device=params[0].device)
        mine = buffer.narrow(0, rank * total, total)
        for dst, src in zip(mine.split(sizes), flat, strict=True):  # copy-in
            dst.copy_(src)
        if world > 1:
            comm.all_gather(buffer, mine, group=group)
        kept = [[(t.numel(), t.dtype) for t in ts] for ts in inputs]  # not the inputs: they may be freed now
        return cls(params, dict(extensions), kept, buffer, sizes, as_bytes, world)

    @torch.no_grad()
    def copy_out(self) -> None:
        """Each input's columns of the N rows into its output; then each extension's post hook."""
        rows = self.buffer.view(self.world, -1)
        columns = iter(rows.split(self.sizes, dim=1))
        for p, inputs in zip(self.params, self.inputs, strict=True):
            if p not in self.extensions:  # a plain parameter: its N chunks, typed again, into its full buffer
                got = next(columns)
                copy_out_param(p, got.contiguous().view(inputs[0][1]) if self.as_bytes else got)
                continue
            ext = self.extensions[p]
            outputs = ext.alloc_outputs(inputs, self.world, rows.device)
            with torch.autograd._unsafe_preserve_version_counter(tuple(outputs)):
                for out in outputs:
                    dst = out.view(self.world, -1)
                    (dst.view(torch.uint8) if self.as_bytes else dst).copy_(next(columns))
            ext.post_all_gather(p)
