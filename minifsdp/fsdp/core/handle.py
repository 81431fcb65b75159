"""One unit's parameters through a step: all-gather, use as views, free (``FlatParamHandle``).

One unit's tensors, rank r of N, a sharded plan.  Three names, three tensors:

    flat_param       [ shard r ]                    the nn.Parameter the optimizer steps (1/N of the unit)
    padded           [ s0 | s1 | ... | sN-1 ]       the all-gather's output: the full buffer with its padding;
                                                    its storage is resized to 0 bytes between uses
    unsharded        [ s0 | s1 | ...   ]            padded[:numel], the autograd leaf the views come from
    unsharded.grad   [ g ...           ]            summed by autograd, reduce-scattered, dropped

``padded`` through one use (``state``: a :class:`HandleState`, ``state.py``):

    start_unshard   storage resized to padded_numel elements; the all-gather issued      GATHERING
    wait_unshard    the all-gather done: every rank's shard is in ``padded``              UNSHARDED
                    (the forward or backward computes with views of ``unsharded``)
    end_use         storage resized to 0 bytes: the tensor objects and their views stay,  SHARDED
                    their memory goes (until the next start_unshard)

torch's ``FlatParamHandle.unshard`` is ``_alloc_padded_unsharded_flat_param``, ``_all_gather_flat_param``
and ``_use_unsharded_flat_param``; its ``reshard`` is ``_use_sharded_flat_param`` and
``_free_unsharded_flat_param``, which resizes the storage to 0 as ours does (``_free_storage``).

Why a separate leaf, not ``flat_param`` itself as torch does?  torch swaps ``flat_param.data``
between the shard and the full buffer at each use; keeping the two apart makes each tensor mean
one thing at every moment, at the cost of this Note:

Note (freeing without breaking autograd): backward needs the tensors the forward saved
(a Linear saves its weight view).  We free a full buffer by resizing its *storage* to 0
bytes; before the backward we resize it back and all-gather into the same storage, so
every saved view sees the numbers again.  ``unsharded`` gets its data by ``.data =`` and
so has its own version counter: the all-gather writing into ``padded`` is invisible to
autograd's "modified by an inplace operation" check, as in torch FSDP1.

Note (NO_SHARD): nothing to gather; ``unsharded`` *is* ``flat_param``, its gradient all-reduced in
place.  With ``MixedPrecision(param_dtype=...)`` the compute copy is a *cast* of ``flat_param``
(``casts_unsharded``) of all of it, made at each use and freed after it, as torch's ``_mp_shard``.

Note (one job): the handle owns a unit's tensors and the collectives that move them, and never calls back
into its unit (but through the post-backward hook the step gives it): the step (``fsdp.py``) decides *when*.
torch's counterpart: ``FlatParamHandle`` (``_flat_param.py``: ``unshard``, ``reshard``, ``_use_unsharded_views``).
"""

from enum import Enum, auto

import torch
import torch.nn as nn

from minifsdp.fsdp.core.flat_param import FlatParamLayout, flatten, shard, unflatten
from minifsdp.fsdp.core.gradient import UnitGradient
from minifsdp.fsdp.core.mixed_precision import MixedPrecision, resolve_dtypes


class HandleState(Enum):  # what the flat parameter holds (core/state.py draws the machine)
    SHARDED = auto()  # the full buffer's storage is 0 bytes: this rank holds its 1/N shard only
    GATHERING = auto()  # an all-gather into the full buffer is in flight (e.g. a prefetch)
    UNSHARDED = auto()  # the full buffer holds every rank's shard: the whole flat parameter

class _OneCall(torch.autograd.Function):
    """``unsharded`` as one call of the unit sees it, under MixedPrecision, where torch's flat parameter changes dtype
    at every reshard and autograd gives a leaf whose dtype changed a new AccumulateGrad node: each call adds its
    gradient to ``.grad`` alone, ``(G + g2) + g1``, not ``G + (g2 + g1)`` (an ulp apart in bf16).  This backward adds
    the same way (NO_SHARD's cast copy: on into ``flat_param.grad``) and hands the leaf nothing."""
    @staticmethod
    def forward(ctx, leaf: torch.Tensor, handle) -> torch.Tensor:
        ctx.handle = handle
        return leaf.view_as(leaf)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        h = ctx.handle
        h.unsharded.grad = grad if h.unsharded.grad is None else h.unsharded.grad.add_(grad)
        if h.casts_unsharded:
            h.gradient.take_cast_grad()
        return None, None

class FlatParamHandle:
    """One unit's flat parameter: layout, local shard, full buffer; ``comm`` from ``get_collectives``."""

    def __init__(self, module: nn.Module, layout: FlatParamLayout, groups, plan, comm,
                 mixed_precision: MixedPrecision | None = None):
        dtypes = {s.param.dtype: s.fqn for s in reversed(layout.slots)}  # each dtype's first parameter
        if len(dtypes) > 1:  # torch: "Must flatten tensors with uniform dtype"
            raise ValueError(f"FSDP unit mixes parameter dtypes ({', '.join(f'{n}: {d}' for d, n in dtypes.items())})"
                             "; one flat parameter has one dtype. Cast the module to one dtype first "
                             "(module.to(torch.float32)), or wrap the odd part in its own unit.")
        self.module, self.layout, self.groups, self.plan, self.comm = module, layout, groups, plan, comm
        self.sharded, self.mixed_precision = plan.shards_params, mixed_precision  # fixed at wrap time
        self.rank = groups.shard_rank if self.sharded else 0
        self.dtypes = resolve_dtypes(mixed_precision, layout.slots[0].param.dtype)
        self.casts_unsharded = self.dtypes.casts_params and not self.sharded  # NO_SHARD: cast, no gather
        self.calls_alone = self.dtypes.casts_params  # each call's views through a _OneCall (fixed at wrap time)
        self.frees = self.sharded or self.casts_unsharded  # the compute buffer is freed between uses
        self.gradient = UnitGradient(self)  # (it reads the plan and mixed_precision only)
        full = flatten(layout)
        requires_grad = any(s.requires_grad for s in layout.slots)
        self.flat_param = nn.Parameter(shard(full, self.rank, layout.world_size), requires_grad=requires_grad)
        if self.frees:
            del full  # first: at most one unit-sized copy beside the originals
            self.unsharded = self.flat_param.new_empty(0, dtype=self.dtypes.param, requires_grad=requires_grad)
            self.padded = self.new_full_buffer()
            self.state = HandleState.SHARDED
        else:
            self.unsharded = self.padded = self.flat_param
            self.state = HandleState.UNSHARDED
        # while GATHERING (work, the shard being sent); shard_version() at the last gather (stale() reads it):
        self.gathering = self.gathered_from = None
        self.views_prefetched = False  # a forward prefetch made the views: the unit's own pre-forward keeps them
        self.name = "unit"  # its module path, set by the root (for messages and traces)
        # what autograd calls once the full gradient is summed (the step's post-backward hook); its registration
        self.post_backward_hook = self.post_backward_registered = None

    def new_full_buffer(self) -> torch.Tensor:
        """A freed ``padded`` buffer in the compute dtype; ``unsharded`` (the same leaf) becomes its first numel
        (NO_SHARD: all of it, its padding too, as the flat parameter it is a cast of)."""
        padded = torch.empty(self.layout.padded_numel, dtype=self.dtypes.param, device=self.flat_param.device)
        self.unsharded.data = padded[: self.layout.numel] if self.sharded else padded  # own version counter: Note
        padded.untyped_storage().resize_(0)  # starts freed
        return padded

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

    # ------------------------------------------------------------------ gather and free
    def start_unshard(self) -> None:
        """Issue the all-gather (async); with mixed precision, of the shard cast to the compute dtype."""
        if self.stale():
            self.end_use(free=True)  # kept since its gather, but an optimizer step changed the shard since
        if self.state is not HandleState.SHARDED:
            return
        self.gathered_from = self.shard_version()
        self.padded.untyped_storage().resize_(self.padded.numel() * self.padded.element_size())
        if self.casts_unsharded:  # NO_SHARD: torch's _mp_shard.copy_(local shard), nothing to gather
            self.padded.copy_(self.flat_param.data)
            self.state = HandleState.UNSHARDED
            return
        local = self.flat_param.data
        # torch casts the same way before its gather: FlatParamHandle.pre_unshard -> _use_low_precision_shard
        if self.padded.dtype != local.dtype:
            local = local.to(self.padded.dtype)  # one rounding, on 1/N of the numbers
        work = self.comm.all_gather(self.padded, local, group=self.groups.shard, async_op=True)
        self.gathering = (work, local)  # the sent tensor stays alive until the all-gather is done
        self.state = HandleState.GATHERING

    def wait_unshard(self) -> None:
        if self.state is HandleState.GATHERING:
            self.gathering[0].wait()
            self.gathering = None
            self.state = HandleState.UNSHARDED

    def end_use(self, free: bool) -> None:
        """A forward or backward is done with the full buffer: free it (``free``) or keep it for the next use;
        NO_SHARD's low-precision copy is freed either way (torch's ``reshard(free_unsharded_flat_param)``)."""
        self.wait_unshard()  # never free a buffer an all-gather is still writing
        self.views_prefetched = False  # (torch's _reshard: _prefetched = False, freed or not)
        if self.frees and self.state is HandleState.UNSHARDED and (free or self.casts_unsharded):
            self.padded.untyped_storage().resize_(0)
            self.state = HandleState.SHARDED

    def shard_version(self) -> tuple[int, ...]:
        """The version counters of what the optimizer steps: an in-place update (an optimizer step) bumps one."""
        return (self.flat_param._version, *(p._version for p in self.optimizer_params() if p is not self.flat_param))

    def stale(self) -> bool:
        """The full buffer is there, but the shard changed since it was gathered."""
        return self.frees and self.state is not HandleState.SHARDED and self.gathered_from != self.shard_version()

    def register_post_backward_hook(self) -> None:
        """torch's ``_register_post_backward_hook``: call ``post_backward_hook`` once autograd has accumulated the
        full gradient (a hook on the gradient leaf, ``unsharded``): once, as soon as the leaf requires grad.

        Why after accumulation?  Autograd sums every use's contribution (each view, a tied weight's two names)
        before the leaf's AccumulateGrad runs once, so this hook sees the whole gradient.  torch registers on
        that AccumulateGrad node (``flat_param.expand_as(flat_param).grad_fn.next_functions[0][0]``) once, and
        holds it (the leaf's reference is weak); so do we where each call's gradient comes in alone
        (``_OneCall``): the node runs after them all with none to add, when a hook on the leaf would not run."""
        if self.unsharded.requires_grad and self.post_backward_registered is None:
            node = torch.autograd.graph.get_gradient_edge(self.unsharded).node if self.calls_alone else None
            self.post_backward_registered = (node, node.register_hook(self.post_backward_hook)) if node else \
                self.unsharded.register_post_accumulate_grad_hook(self.post_backward_hook)

    # ------------------------------------------------------------------ where the module's names point
    @torch.enable_grad()  # a forward prefetch may run under no_grad (a reentrant checkpoint's): views need a graph
    def use_unsharded_views(self) -> None:
        """Forward: every original name is a view of the full buffer (autograd flows to it); a tied weight's
        second name gets the *same* view, so both uses' gradients sum."""
        views = unflatten(self.view_source(), self.layout)
        # plain attributes, through setattr: a module that overrides __setattr__ sees every switch, as under torch
        for slot, v in zip(self.layout.slots, views):
            setattr(slot.module, slot.name, v)
        for sh in self.layout.shared:
            setattr(sh.module, sh.name, views[sh.primary])

    def view_source(self) -> torch.Tensor:  # what a forward call's views are cut from (``_OneCall``)
        return _OneCall.apply(self.unsharded, self) if self.calls_alone else self.unsharded

    def use_sharded_views(self) -> None:
        """At wrap time and after ``summon_full_params`` (``minifsdp/fsdp/full_params.py``): every original
        name is an empty tensor (no stale view)."""
        empty = self.flat_param.data.new_empty(0)
        for slot in self.layout.slots + self.layout.shared:
            setattr(slot.module, slot.name, empty)

    # ------------------------------------------------------------------ what the optimizer steps
    def optimizer_params(self) -> list[nn.Parameter]:
        """What the optimizer steps (``model.parameters()`` yields it): the flat shard; or, where an extension
        keeps the originals (``slot.param``) as views of it, those."""
        kept = [s.param for s in self.layout.slots if s.param is not None]
        return kept or [self.flat_param]
