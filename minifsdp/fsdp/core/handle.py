"""One unit's parameters through a step: gather, use as views, free.

    forward    all-gather shards -> full flat buffer -> views as module.weight ... -> run
               FULL_SHARD / HYBRID_SHARD: free the full buffer after (not the root's)
    backward   pre-backward: all-gather again if freed; autograd sums every view's gradient
               into the full flat gradient; post-backward: free, reduce (``gradient.py``)

One unit's buffers, rank r of N, FULL_SHARD:

    flat_param       [ shard r ]                    nn.Parameter, what the optimizer steps
    padded           [ s0 | s1 | ... | sN-1 ]       all-gather target; storage freed between uses
    unsharded        [ s0 | s1 | ...   ]            autograd leaf = padded[:numel]; views come from it
    unsharded.grad   [ g ...           ]            summed by autograd, reduce-scattered, dropped

Note (freeing without breaking autograd): backward needs the tensors the forward saved
(a Linear saves its weight view).  We free a full buffer by resizing its *storage* to 0
bytes; before the backward we resize it back and all-gather into the same storage, so
every saved view sees the numbers again.  ``unsharded`` gets its data by ``.data =`` and
so has its own version counter: the all-gather writing into ``padded`` is invisible to
autograd's "modified by an inplace operation" check, as in torch FSDP1.

Note (NO_SHARD): nothing to gather; ``unsharded`` *is* ``flat_param`` and its gradient is
all-reduced in place.  With ``MixedPrecision(param_dtype=...)`` the compute copy is a
*cast* of ``flat_param`` instead (``casts_unsharded``), made at each use and freed after
it, as torch's ``_mp_shard``.

Note (one job): the handle owns a unit's tensors and the collectives that move them; it
never calls back into its unit.  The unit (``fsdp.py``) decides *when*; the handle reports
what it did to an attached tracer and nothing else.  ``use_orig_params=True`` (views of
the original parameters) is a subclass chosen at wrap time: ``minifsdp/fsdp/orig_params.py``.
"""

import contextlib

import torch
import torch.nn as nn

from minifsdp.fsdp.core.flat_param import build_layout, flatten, shard, unflatten
from minifsdp.fsdp.core.gradient import UnitGradient
from minifsdp.fsdp.core.mixed_precision import MixedPrecision, resolve_dtypes
from minifsdp.fsdp.core.state import HandleState
from minifsdp.fsdp.core.strategy import SHARDED, ShardGroups, ShardingStrategy


class FlatParamHandle:
    """One unit's flat parameter: layout, local shard, full buffer; ``comm`` from ``get_collectives``."""

    def __init__(self, module: nn.Module, params: list[nn.Parameter], groups: ShardGroups,
                 strategy: ShardingStrategy, comm, mixed_precision: MixedPrecision | None = None,
                 align_numel: int = 0):
        self.module, self.groups, self.strategy, self.comm = module, groups, strategy, comm
        self.sharded = strategy in SHARDED  # fixed at wrap time, as the two below
        n = groups.shard_size if self.sharded else 1
        self.rank = groups.shard_rank if self.sharded else 0
        self.mixed_precision = mixed_precision
        self.dtypes = resolve_dtypes(mixed_precision, params[0].dtype)
        self.casts_unsharded = self.dtypes.casts_params and not self.sharded  # NO_SHARD: cast, no gather
        self.frees = self.sharded or self.casts_unsharded  # the compute buffer is freed between uses
        self.layout = build_layout(module, params, n, align_numel)
        full = flatten(self.layout)
        requires_grad = any(p.requires_grad for p in params)
        self.flat_param = nn.Parameter(shard(full, self.rank, n), requires_grad=requires_grad)  # n = 1: all
        if self.frees:
            del full  # first: at most one unit-sized copy beside the originals
            self.unsharded = torch.empty(0, dtype=self.dtypes.param, device=self.flat_param.device)
            self.unsharded.requires_grad_(requires_grad)
            self.padded = self.new_full_buffer()
            self.state = HandleState.SHARDED
        else:
            self.unsharded = self.padded = self.flat_param
            self.state = HandleState.UNSHARDED
        self.gathering = None  # while GATHERING: (work, the local shard being sent)
        self.gathered_from = None  # shard_version() at the last gather: an optimizer step since makes it stale
        self.name = "unit"  # its module path, set by the root (for the tracer)
        self.tracer = None  # a tools.tracing.Tracer while one is attached
        self.gradient = UnitGradient(self)

    def new_full_buffer(self) -> torch.Tensor:
        """A freed ``padded`` buffer in the compute dtype; ``unsharded`` (the same leaf) becomes its first numel."""
        padded = torch.empty(self.layout.padded_numel, dtype=self.dtypes.param, device=self.flat_param.device)
        self.unsharded.data = padded[: self.layout.numel]  # own version counter: see Note
        padded.untyped_storage().resize_(0)  # starts freed
        return padded

    def span(self, kind: str):
        """Record ``kind`` on the attached tracer from enter to exit (nothing without one)."""
        return self.tracer.span(kind, self.name) if self.tracer is not None else contextlib.nullcontext()

    def take_over_params(self) -> None:
        """The originals leave their modules (no full-size copy kept) and the wrapped module registers
        ``_flat_param``: ``model.parameters()`` yields the flat shard, as torch's."""
        for slot in self.layout.slots:
            del slot.module._parameters[slot.name]
            slot.param = None
        for sh in self.layout.shared:
            sh.module._parameters.pop(sh.name, None)
        self.use_sharded_views()
        self.module.register_parameter("_flat_param", self.flat_param)  # torch's name

    def unshard(self) -> None:
        """All-gather the shards into the full buffer (nothing if already there); waits."""
        self.start_unshard()
        self.wait_unshard()

    def start_unshard(self, prefetch: bool = False) -> None:
        """Issue the all-gather (async); with mixed precision, of the shard cast to the compute dtype."""
        if self.stale():
            self.reshard()  # kept since its gather, but an optimizer step changed the shard since
        if self.state is not HandleState.SHARDED:
            return
        self.gathered_from = self.shard_version()
        self.padded.untyped_storage().resize_(self.padded.numel() * self.padded.element_size())
        if self.casts_unsharded:  # NO_SHARD: torch's _mp_shard.copy_(local shard), nothing to gather
            self.padded.copy_(self.flat_param.data)
            self.state = HandleState.UNSHARDED
            return
        if self.tracer is not None:
            self.tracer.instant("all-gather issued", self.name, prefetch=prefetch)
        local = self.flat_param.data
        if self.padded.dtype != local.dtype:
            local = local.to(self.padded.dtype)  # one rounding, on 1/N of the numbers
        work = self.comm.all_gather(self.padded, local, group=self.groups.shard, async_op=True)
        self.gathering = (work, local)  # the sent tensor stays alive until the all-gather is done
        self.state = HandleState.GATHERING

    def wait_unshard(self) -> None:
        if self.state is HandleState.GATHERING:
            with self.span("all-gather wait"):
                self.gathering[0].wait()
            self.gathering = None
            self.state = HandleState.UNSHARDED

    def reshard(self) -> None:
        """Free the full buffer (sharded strategies, or NO_SHARD's low-precision copy)."""
        self.wait_unshard()  # never free a buffer an all-gather is still writing
        if self.frees and self.state is HandleState.UNSHARDED:
            self.padded.untyped_storage().resize_(0)
            self.state = HandleState.SHARDED

    def shard_version(self) -> tuple[int, ...]:
        """The local shard's version counter(s): an in-place update (an optimizer step) bumps them."""
        return (self.flat_param._version,)

    def stale(self) -> bool:
        """The full buffer is there, but the shard changed since it was gathered."""
        return self.frees and self.state is not HandleState.SHARDED and self.gathered_from != self.shard_version()

    @contextlib.contextmanager
    def full_precision(self):
        """summon_full_params under mixed precision: gather the fp32 shards into a fp32 buffer; the
        low-precision buffer and its autograd leaf (with its hook) are set aside and put back."""
        if not self.dtypes.casts_params:
            yield
            return
        self.reshard()
        low = self.padded, self.unsharded
        self.padded = torch.empty(self.layout.padded_numel, dtype=self.dtypes.orig, device=self.flat_param.device)
        self.unsharded = self.padded[: self.layout.numel]
        try:
            yield
        finally:
            self.reshard()
            self.padded, self.unsharded = low

    def use_unsharded_views(self, in_forward: bool = False) -> None:
        """Forward and backward: every original name is a view of the full buffer (autograd flows to it); a
        tied weight's second name gets the *same* view, so both uses' gradients sum."""
        views = unflatten(self.unsharded, self.layout)
        for slot, v in zip(self.layout.slots, views):
            setattr(slot.module, slot.name, v)  # a plain attribute (the name is no registered parameter)
        for sh in self.layout.shared:
            setattr(sh.module, sh.name, views[sh.primary])

    def use_sharded_views(self) -> None:
        """Between uses: every original name is an empty tensor (no stale view of a freed buffer)."""
        empty = self.flat_param.data.new_empty(0)
        for slot in self.layout.slots + self.layout.shared:
            setattr(slot.module, slot.name, empty)

    # Where the names point around a use: here nothing changes (the forward's views see the numbers again
    # when the backward gathers into the same storage); use_orig_params (orig_params.py) switches them.
    def after_forward(self) -> None: ...
    def before_backward(self) -> None: ...
    def after_backward(self) -> None: ...

    def use_full_params(self) -> None:
        """summon_full_params: every original name is an ``nn.Parameter`` of its full shape, sharing the full
        buffer's memory outside autograd (an edit lands in it; :meth:`write_back` copies it into the shard)."""
        self.module._parameters.pop("_flat_param")  # torch shows the originals, not the flat parameter
        views = unflatten(self.unsharded.detach(), self.layout)
        params = [nn.Parameter(v, requires_grad=slot.requires_grad) for slot, v in zip(self.layout.slots, views)]
        for slot, p in zip(self.layout.slots, params):
            slot.module.__dict__.pop(slot.name, None)  # the plain attribute would hide the registered one
            slot.module._parameters[slot.name] = p
        for sh in self.layout.shared:
            sh.module.__dict__.pop(sh.name, None)
            sh.module._parameters[sh.name] = params[sh.primary]

    def drop_full_params(self) -> None:
        """Undo :meth:`use_full_params`."""
        for slot in self.layout.slots + self.layout.shared:
            slot.module._parameters.pop(slot.name, None)
        self.use_sharded_views()
        self.module.register_parameter("_flat_param", self.flat_param)

    def optimizer_params(self) -> list[nn.Parameter]:
        """What the optimizer steps for this unit (``model.parameters()`` yields it): the flat shard."""
        return [self.flat_param]

    def local_pieces(self) -> list[tuple[int, int]]:
        """For each slot, the [lo, hi) of this rank's ``flat_param`` it covers."""
        if self.sharded:
            return self.layout.local_pieces(self.rank)
        return [(s.offset, s.offset + s.numel) for s in self.layout.slots]

    def write_back(self) -> None:
        """Copy the local part of the full buffer back into the shard (after summon_full_params edits)."""
        if self.frees and self.state is HandleState.UNSHARDED:
            start, end = self.layout.shard_range(self.rank)
            self.flat_param.data.copy_(self.padded[start:end])
