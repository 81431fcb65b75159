"""Chapter 5: ``fully_shard(module)``, FSDP2's per-module API, and the hooks that drive it.

Usage, as torch's (bottom-up: each block, then the root)::

    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    loss = model(x, y); loss.backward(); opt.step()

What one call does to ``module``:

1. takes the parameters of ``module`` that no earlier ``fully_shard`` call took (a tied weight once,
   with every ``(module, name)`` that holds it) and makes a :class:`~minifsdp.fsdp2.param_group.FSDPParamGroup`:
   each parameter replaced by an ``nn.Parameter`` wrapping a torch ``DTensor`` whose local tensor is this rank's
   rows (see :mod:`minifsdp.fsdp2.param`: ``Shard(0)`` on the mesh, so torch's own functions see the whole).
   Buffers stay as they are (replicated); frozen parameters are sharded and gathered but get no gradient.
2. hooks: forward pre-hook (all-gather, cast inputs, put an autograd identity on the inputs whose backward
   is the post-backward), forward hook (reshard if ``reshard_after_forward``; a tensor hook on the outputs
   whose call is the pre-backward), and, queued by the first pre-backward, an end-of-backward callback on
   the root (post-backward for groups autograd never reached, such as the root whose inputs are token ids).
3. changes the module's class to ``FSDP<Orig>`` (a subclass made once per class, with :class:`FSDPModule`
   first in its bases), exactly as torch does, so ``model.unshard()``, ``model.reshard()`` and
   ``model.set_requires_gradient_sync(False)`` exist on the module itself and ``isinstance(model, Orig)`` holds.

``reshard_after_forward``: ``None`` (torch's default) means True for every module except the root, which
keeps its parameters from forward to backward (they would be gathered again at once); True / False as given;
an int k (dividing the shard size N) reshards to groups of k consecutive ranks after forward, so backward's
all-gather stays inside k ranks (e.g. one node) at the cost of holding 1/k instead of 1/N in between.

How ours differs from torch's, on purpose: ``mesh`` may also be a process group (made a 1-D mesh over its
ranks); with None it is the world, a 2-D ``DeviceMesh`` ``(replicate, shard)`` is HSDP, as torch's.  Everything
runs on the caller's thread (no streams: on CPU gloo there is nothing to overlap with),
so the collectives are issued in torch's order but never overlap compute.  Prefetching: the implicit
backward prefetch of the previous group, and the explicit ``set_modules_to_forward_prefetch`` /
``set_modules_to_backward_prefetch``, issue gathers in torch's order (on one thread a prefetch only moves a
gather earlier).  Not built: ``offload_policy`` other than none, a list of modules in one call,
``ignored_params``, ``shard_placement_fn`` (only dim 0).  The extra keyword ``collectives`` picks torch's
collectives (default, bitwise parity) or our ring (``"ring"``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.autograd import Variable
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from minifsdp.comm import get_collectives
from minifsdp.fsdp2.mixed_precision import MixedPrecisionPolicy
from minifsdp.fsdp2.nest import cast_floating, tensors_in
from minifsdp.fsdp2.param_group import CommContext, FSDPParamGroup, TrainingState

__all__ = ["fully_shard", "FSDPModule", "FSDPState", "fsdp_state"]

_STATE_ATTR = "_minifsdp_fsdp2_state"


def fsdp_state(module: nn.Module) -> "FSDPState | None":
    """The state ``fully_shard`` attached to ``module``, or None."""
    return module.__dict__.get(_STATE_ATTR)


class _RootContext:
    """What the root shares with every state below it, made at the root's first forward."""

    def __init__(self, states: list["FSDPState"]):
        self.all_states = states
        self.comm = CommContext()
        self.callback_queued = False
        self.iter_forward_root: FSDPState | None = None


class FSDPState:
    """Per ``fully_shard`` call: the module, its group (None if it took no parameter), its hooks' logic."""

    def __init__(self, module: nn.Module, group: FSDPParamGroup | None, mp_policy: MixedPrecisionPolicy,
                 auto_reshard: bool):
        self.module = module
        self.param_group = group
        self.mp_policy = mp_policy
        self.auto_reshard = auto_reshard
        self.is_root: bool | None = None
        self.ctx: _RootContext | None = None
        self.training_state = TrainingState.IDLE
        self.forward_prefetch: list[FSDPState] = []  # set_modules_to_forward_prefetch
        self.backward_prefetch: list[FSDPState] = []  # set_modules_to_backward_prefetch

    # ---------------------------------------------------------------- root
    def _lazy_init(self) -> None:
        if self.is_root is not None:
            return
        self.is_root = True
        states = []
        for sub in self.module.modules():
            state = fsdp_state(sub)
            if state is None:
                continue
            if state is not self:
                if state.is_root is not None:
                    raise RuntimeError("fully_shard: run the forward through the root module first")
                state.is_root = False
            states.append(state)
        ctx = _RootContext(states)
        for state in states:
            state.ctx = ctx
            if state.param_group is not None:
                state.param_group.comm_ctx = ctx.comm
        if self.auto_reshard and self.param_group is not None:
            self.param_group.reshard_after_forward = False  # the root keeps its parameters for backward

    # ---------------------------------------------------------------- hooks
    def pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if self.training_state is TrainingState.PRE_BACKWARD:  # a recomputation inside backward
            if self.param_group is not None:
                self.param_group.unshard()
                self.param_group.wait_for_unshard()
            return self._cast_inputs(args, kwargs)
        first_in_pass = self.training_state is not TrainingState.FORWARD
        self.training_state = TrainingState.FORWARD
        self._lazy_init()
        if self.ctx.iter_forward_root is None:
            self.ctx.iter_forward_root = self
        args, kwargs = self._cast_inputs(args, kwargs)
        if self.param_group is not None:
            args, kwargs = self.param_group.pre_forward(args, kwargs)
        if first_in_pass:  # explicit forward prefetch: gather the listed modules now, before they run
            for target in self.forward_prefetch:
                if target.param_group is not None:
                    target.param_group.unshard()
        return args, kwargs

    def post_forward(self, module: nn.Module, args: tuple, output: Any) -> Any:
        if self.training_state is TrainingState.PRE_BACKWARD:
            return cast_floating(output, self.mp_policy.output_dtype)
        if self.param_group is not None:
            self.param_group.post_forward()
        if torch.is_grad_enabled():
            for t in tensors_in(output):  # dataclasses included (see minifsdp.fsdp2.nest)
                if t.requires_grad:
                    t.register_hook(self._pre_backward)
        self.training_state = TrainingState.IDLE
        if self.ctx.iter_forward_root is self:
            self.ctx.iter_forward_root = None
        return cast_floating(output, self.mp_policy.output_dtype)

    def _cast_inputs(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if not (self.mp_policy.cast_forward_inputs and self.mp_policy.param_dtype):
            return args, kwargs
        return cast_floating(args, self.mp_policy.param_dtype), cast_floating(kwargs, self.mp_policy.param_dtype)

    def _pre_backward(self, grad: torch.Tensor) -> torch.Tensor:
        self.training_state = TrainingState.PRE_BACKWARD
        ctx = self.ctx
        if not ctx.callback_queued:
            ctx.callback_queued = True
            Variable._execution_engine.queue_callback(self._end_of_backward)
        if self.param_group is not None:
            self.param_group.pre_backward(implicit_prefetch=not self.backward_prefetch)
        for target in self.backward_prefetch:  # explicit: these instead of the previous group
            if target.param_group is not None:
                target.param_group.unshard()
        return grad

    def _end_of_backward(self) -> None:
        ctx = self.ctx
        for state in ctx.all_states:
            if state.param_group is not None:
                state.param_group.finish_backward()
            state.training_state = TrainingState.IDLE
        ctx.comm.post_forward_order.clear()
        ctx.iter_forward_root = None
        ctx.callback_queued = False


class UnshardHandle:
    """What ``unshard(async_op=True)`` returns: the all-gather ran; ``wait()`` copies out and installs the
    full parameters (torch's handle waits for the collective first; here it already finished)."""

    def __init__(self, group: FSDPParamGroup | None):
        self.group = group

    def wait(self) -> None:
        if self.group is not None:
            self.group.wait_for_unshard()
            self.group = None


class FSDPModule:
    """Mixed into a sharded module's class (``FSDP<Orig>``): the methods torch's ``FSDPModule`` offers."""

    def _fsdp_states(self, recurse: bool) -> list[FSDPState]:
        modules = self.modules() if recurse else [self]
        return [s for m in modules if (s := fsdp_state(m)) is not None]

    def unshard(self, async_op: bool = False) -> "UnshardHandle | None":
        """All-gather this module's parameters now (they stay gathered until :meth:`reshard`).

        The collective is synchronous here; with ``async_op=True`` the full parameters are installed by the
        returned handle's ``wait()`` (or by the module's next forward), as torch's."""
        group = fsdp_state(self).param_group
        if group is not None:
            group.unshard()
        if async_op:
            return UnshardHandle(group)
        if group is not None:
            group.wait_for_unshard()
        return None

    def reshard(self) -> None:
        """Free this module's full parameters; the modules hold the sharded ones again."""
        group = fsdp_state(self).param_group
        if group is not None:
            group.reshard()

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """False: backward keeps full gradients on each rank unreduced (accumulation); True: reduce-scatter."""
        for s in self._fsdp_states(recurse):
            if s.param_group is not None:
                s.param_group.reduce_grads = requires_gradient_sync

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        for s in self._fsdp_states(recurse):
            if s.param_group is not None:
                s.param_group.reshard_after_backward = reshard_after_backward

    def set_modules_to_forward_prefetch(self, modules: list[nn.Module]) -> None:
        """In this module's pre-forward, after its own all-gather, all-gather these modules' parameters too."""
        fsdp_state(self).forward_prefetch = [fsdp_state(m) for m in modules]

    def set_modules_to_backward_prefetch(self, modules: list[nn.Module]) -> None:
        """In this module's pre-backward, all-gather these modules' parameters (replaces the implicit
        prefetch of the module whose forward ran just before this one)."""
        fsdp_state(self).backward_prefetch = [fsdp_state(m) for m in modules]

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        for s in self._fsdp_states(recurse):
            s.auto_reshard = False
            if s.param_group is not None:
                s.param_group.reshard_after_forward = reshard_after_forward


_FSDP_CLASSES: dict[type, type] = {}
_NO_MIXED_PRECISION = MixedPrecisionPolicy()  # frozen, so safe as a shared default


def _swap_class(module: nn.Module) -> None:
    cls = type(module)
    if issubclass(cls, FSDPModule):
        return
    new_cls = _FSDP_CLASSES.get(cls)
    if new_cls is None:
        new_cls = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {})
        _FSDP_CLASSES[cls] = new_cls
    module.__class__ = new_cls


def _resolve_mesh(mesh, module: nn.Module) -> tuple[DeviceMesh, object, object, tuple]:
    """``(device mesh, shard group, replicate group or None, placements)``.

    ``mesh``: None -> the world; a 1-D ``DeviceMesh`` or a process group -> shard over it (``Shard(0)``); a 2-D
    ``DeviceMesh`` -> HSDP, dim 0 replicates and dim 1 shards (``(Replicate(), Shard(0))``, torch's convention).
    A process group becomes a 1-D mesh over its ranks (``DeviceMesh.from_group``: no new group is made)."""
    if mesh is None or not isinstance(mesh, DeviceMesh):
        tensors = [*module.parameters(), *module.buffers()]
        device_type = tensors[0].device.type if tensors and tensors[0].device.type != "meta" else "cpu"
        mesh = DeviceMesh.from_group(dist.group.WORLD if mesh is None else mesh, device_type)
    if mesh.ndim == 1:
        return mesh, mesh.get_group(0), None, (Shard(0),)
    if mesh.ndim == 2:
        if mesh.mesh_dim_names is None:
            raise ValueError("fully_shard: a 2-D mesh is HSDP (replicate, shard): init it with mesh_dim_names, "
                             "e.g. init_device_mesh(device, (2, 2), mesh_dim_names=('replicate', 'shard'))")
        return mesh, mesh.get_group(1), mesh.get_group(0), (Replicate(), Shard(0))
    raise ValueError(f"fully_shard: a mesh of 1 or 2 dimensions, not {mesh.ndim}")


def _post_forward(reshard_after_forward, mesh, group):
    """Resolve an int ``reshard_after_forward=k`` as torch does: 1 -> False, N -> True, otherwise True with a
    group of k consecutive ranks (the mesh's ranks laid out as rows of k) to reshard to after forward."""
    if reshard_after_forward is None or isinstance(reshard_after_forward, bool):
        return reshard_after_forward, None
    k, n = int(reshard_after_forward), dist.get_world_size(group)
    if k < 1 or k > n or n % k != 0:
        raise ValueError(f"fully_shard: an int reshard_after_forward must divide the shard size {n}, not {k}")
    if k in (1, n):
        return k == n, None
    layout = mesh.mesh.view(-1, k).tolist()  # every rank knows the whole layout
    mine, _ = dist.new_subgroups_by_enumeration(layout)  # every rank creates every row's group, same order
    return True, mine


def _managed_params(module: nn.Module) -> tuple[list[nn.Parameter], dict[int, list[tuple[nn.Module, str]]]]:
    """Parameters of ``module`` and its submodules not already taken by a nested ``fully_shard``,
    each once, in ``named_modules`` order, with every (module, name) that holds it."""
    managed, stack = [], [module]
    while stack:
        m = stack.pop(0)
        managed.append(m)
        stack[:0] = [c for c in m.children() if fsdp_state(c) is None]
    params, users = [], {}
    for m in managed:
        for name, p in m._parameters.items():
            if p is None or isinstance(p, DTensor):  # None, or already sharded by a nested fully_shard
                continue
            if id(p) not in users:
                params.append(p)
                users[id(p)] = []
            users[id(p)].append((m, name))
    return params, users


def fully_shard(module: nn.Module, *, mesh=None, reshard_after_forward: bool | int | None = None,
                mp_policy: MixedPrecisionPolicy = _NO_MIXED_PRECISION, offload_policy=None,
                collectives: str = "torch") -> nn.Module:
    """Shard ``module``'s parameters by rows over ``mesh`` (default: the world) and return ``module``.

    Call it on each block first, then on the root.  See the module docstring for what it does and how
    it differs from ``torch.distributed.fsdp.fully_shard``.
    """
    if fsdp_state(module) is not None:
        raise ValueError(f"fully_shard was already applied to this {type(module).__name__}")
    if offload_policy is not None and type(offload_policy).__name__ != "OffloadPolicy":
        raise NotImplementedError("fully_shard: CPU offloading (CPUOffloadPolicy) is not built here")
    device_mesh, group, replicate_group, placements = _resolve_mesh(mesh, module)
    reshard_after_forward, post_forward_group = _post_forward(reshard_after_forward, device_mesh, group)
    params, users = _managed_params(module)
    param_group = None
    if params:
        param_group = FSDPParamGroup(params, users, group, get_collectives(collectives), mp_policy,
                                     reshard_after_forward is not False, replicate_group, post_forward_group,
                                     device_mesh, placements)
    state = FSDPState(module, param_group, mp_policy, auto_reshard=reshard_after_forward is None)
    module.__dict__[_STATE_ATTR] = state
    module.register_forward_pre_hook(state.pre_forward, prepend=True, with_kwargs=True)
    module.register_forward_hook(state.post_forward)
    _swap_class(module)
    return module
