"""Rank functions for tests/test_step_picture.py: one training step of each core, recorded event by event.

The step: TinyGPT (two blocks), each block wrapped and the root around them, FULL_SHARD, BACKWARD_PRE (FSDP1's
default; fully_shard's implicit prefetch), on CPU, two ranks.  Two steps are recorded (an optimizer step between
them); each must match the picture.

What is recorded, ours: each hook as it is entered (pre-forward, post-forward, pre-backward, post-backward, the end
of backward), the pre-backward that queues that end, and what the unit's parameters and gradient go through
inside them: an all-gather (the c10d op itself, seen by a dispatch mode, named by the unit whose method issued it),
its completion (FSDP1: ``wait_unshard`` finds it in flight; FSDP2: ``wait_for_unshard``'s copy-out), a free (the
full parameters released), a reduce-scatter (the c10d op) and, FSDP1, its completion (``finish_reduce``).

torch's, recorded in the same run, the same way: its hooks (FSDP1: ``_pre_forward``, ``_post_forward``,
``_pre_backward_hook``, ``_post_backward_hook``, ``_post_backward_final_callback``; fully_shard: the group's
``pre_forward``, ``post_forward``, ``post_backward``, the state's ``_pre_backward`` and its final callback), the
queueing of that callback, the frees (the full buffer's storage released) and the c10d collectives, named by the
handle or group whose ``_unshard`` / ``_reduce_grad`` (FSDP1) or ``unshard`` / ``post_backward`` (fully_shard) issued
them; FSDP1's all-gathers issued inside ``_prefetch_handle`` are marked "prefetch"; fully_shard's copy-outs
(``wait_for_unshard`` with a gather pending).
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from minifsdp.models import Block, CharCorpus, TinyGPT

STEPS = 2


class Log(TorchDispatchMode):
    """The events of one step, in order; a c10d all-gather / reduce-scatter is logged as ("AG" / "RS", owner),
    the owner being the unit whose method is running (``owned``)."""

    def __init__(self):
        super().__init__()
        self.events: list[tuple[str, ...]] = []
        self.owners: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._opname if func.namespace == "c10d" else ""
        if "allgather" in name or "reduce_scatter" in name:
            self.events.append(("AG" if "allgather" in name else "RS", self.owners[-1] if self.owners else "?"))
        return func(*args, **(kwargs or {}))

    @contextlib.contextmanager
    def owned(self, owner: str):
        self.owners.append(owner)
        try:
            yield
        finally:
            self.owners.pop()


@contextlib.contextmanager
def patched(*patches):
    """Replace ``(obj, attr, wrapper)``'s ``obj.attr`` by ``wrapper(original)`` inside the block."""
    saved = [(obj, attr, getattr(obj, attr)) for obj, attr, _ in patches]
    for obj, attr, wrap in patches:
        setattr(obj, attr, functools.wraps(getattr(obj, attr))(wrap(getattr(obj, attr))))
    try:
        yield
    finally:
        for obj, attr, orig in saved:
            setattr(obj, attr, orig)


def short(name: str) -> str:
    """'blocks.0' -> 'b0', '' -> 'root': the picture's names."""
    return "root" if name in ("", "root") else name.replace("blocks.", "b")


def _train(model, log: Log, rank: int, world: int) -> list[list[tuple]]:
    corpus, steps = CharCorpus(), []
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(STEPS):
        x, y = corpus.batch(step, 2, 32, rank, world)
        log.events = []
        with log:
            model(x, y).backward()
        steps.append(log.events)
        opt.step()
        opt.zero_grad()
    return steps


# ----------------------------------------------------------------------------- FSDP1
def _fsdp1_ours(rank, world):
    from minifsdp.fsdp.core import FullyShardedDataParallel as Core
    from minifsdp.fsdp.core.gradient import UnitGradient
    from minifsdp.fsdp.core.handle import FlatParamHandle, HandleState
    from minifsdp.fsdp.core.wrap import transformer_auto_wrap_policy

    log, names = Log(), {}
    name = lambda unit: short(names[id(unit)])  # noqa: E731

    def hook(kind):
        def wrap(orig):
            def run(self, *args, **kwargs):
                log.events.append((kind, name(self)))
                return orig(self, *args, **kwargs)
            return run
        return wrap

    def pre_backward(orig):
        def run(self, grad):
            queued = self._root._root_state.final_callback_queued
            log.events.append(("pre-backward", name(self)))
            at = len(log.events)
            out = orig(self, grad)
            if not queued and self._root._root_state.final_callback_queued:
                log.events.insert(at, ("queue the final callback",))
            return out
        return run

    def final_callback(orig):
        def run(self):
            log.events.append(("final callback",))
            return orig(self)
        return run

    def start_unshard(orig):
        def run(self):
            with log.owned(short(self.name)):
                return orig(self)
        return run

    def wait_unshard(orig):
        def run(self):
            if self.state is HandleState.GATHERING:
                log.events.append(("wait AG", short(self.name)))
            return orig(self)
        return run

    def end_use(orig):
        def run(self, free):
            before = self.state
            out = orig(self, free)
            if before is not HandleState.SHARDED and self.state is HandleState.SHARDED:
                log.events.append(("free", short(self.name)))
            return out
        return run

    def start_reduce(orig):
        def run(self):
            with log.owned(short(self.handle.name)):
                return orig(self)
        return run

    def finish_reduce(orig):
        def run(self):
            done = orig(self)
            if done:
                log.events.append(("wait RS", short(self.handle.name)))
            return done
        return run

    with patched((Core, "_pre_forward", hook("pre-forward")), (Core, "_post_forward", hook("post-forward")),
                 (Core, "_pre_backward_hook", pre_backward), (Core, "_post_backward_hook", hook("post-backward")),
                 (Core, "_post_backward_final_callback", final_callback),
                 (FlatParamHandle, "start_unshard", start_unshard), (FlatParamHandle, "wait_unshard", wait_unshard),
                 (FlatParamHandle, "end_use", end_use), (UnitGradient, "start_reduce", start_reduce),
                 (UnitGradient, "finish_reduce", finish_reduce)):
        model = Core(TinyGPT(seed=0), auto_wrap_policy=functools.partial(transformer_auto_wrap_policy,
                                                                         transformer_layer_cls={Block}))
        from minifsdp.fsdp.core.units import clean_name
        names.update({id(m): clean_name(n) for n, m in model.named_modules()})
        return _train(model, log, rank, world)


def _fsdp1_torch(rank, world):
    import torch.distributed.fsdp._runtime_utils as ru
    import torch.distributed.fsdp.fully_sharded_data_parallel as fsdp_module
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

    log, names, prefetching = Log(), {}, [0]

    def hook(kind, at):  # torch's hooks are functions; ``at``: where the handle is among their arguments
        def wrap(orig):
            def run(*args, **kwargs):
                log.events.append((kind, names.get(id(args[at]), "?")))
                return orig(*args, **kwargs)
            return run
        return wrap

    def final_callback(orig):
        def run(*args, **kwargs):
            log.events.append(("final callback",))
            return orig(*args, **kwargs)
        return run

    def queue(orig):  # _register_post_backward_final_callback(state, module)
        def run(state, module):
            queued = state._post_backward_callback_queued
            out = orig(state, module)
            if not queued and state._post_backward_callback_queued:
                log.events.append(("queue the final callback",))
            return out
        return run

    def owned(orig):  # _unshard(state, handle, ...), _reduce_grad(state, handle)
        def run(state, handle, *args, **kwargs):
            at = len(log.events)
            with log.owned(names.get(id(handle), "?")):
                out = orig(state, handle, *args, **kwargs)
            if prefetching[0]:  # issued inside _prefetch_handle
                log.events[at:] = [(*e, "prefetch") if e[0] == "AG" else e for e in log.events[at:]]
            return out
        return run

    def prefetch(orig):
        def run(*args, **kwargs):
            prefetching[0] += 1
            try:
                return orig(*args, **kwargs)
            finally:
                prefetching[0] -= 1
        return run

    def reshard(orig):  # _reshard(state, handle, free_unsharded_flat_param)
        def run(state, handle, free):
            full = handle.flat_param._full_param_padded.untyped_storage()
            before = full.size()
            out = orig(state, handle, free)
            if before and not full.size():
                log.events.append(("free", names.get(id(handle), "?")))
            return out
        return run

    with patched((fsdp_module, "_pre_forward", hook("pre-forward", 1)),
                 (fsdp_module, "_post_forward", hook("post-forward", 1)),
                 (ru, "_pre_backward_hook", hook("pre-backward", 2)),
                 (ru, "_post_backward_hook", hook("post-backward", 1)),
                 (ru, "_post_backward_final_callback", final_callback),
                 (ru, "_register_post_backward_final_callback", queue),
                 (ru, "_unshard", owned), (ru, "_reduce_grad", owned), (ru, "_prefetch_handle", prefetch),
                 (ru, "_reshard", reshard)):
        model = TorchFSDP(TinyGPT(seed=0), auto_wrap_policy=functools.partial(transformer_auto_wrap_policy,
                                                                              transformer_layer_cls={Block}),
                          device_id=torch.device("cpu"))
        for n, m in model.named_modules():
            if isinstance(m, TorchFSDP) and m._handle is not None:
                names[id(m._handle)] = short(".".join(p for p in n.split(".") if p != "_fsdp_wrapped_module"))
        return _train(model, log, rank, world)


def fsdp1_steps() -> dict:
    """{"ours": [events of each step], "torch": [collectives of each step]} on this rank."""
    rank, world = dist.get_rank(), dist.get_world_size()
    return {"ours": _fsdp1_ours(rank, world), "torch": _fsdp1_torch(rank, world)}


# ----------------------------------------------------------------------------- FSDP2
def _fsdp2_ours(rank, world, mesh):
    from minifsdp.fsdp2 import fully_shard
    from minifsdp.fsdp2.core.param_group import FSDPParamGroup
    from minifsdp.fsdp2.core.state import FSDPState

    log, names = Log(), {}
    state_name = lambda s: short(names[id(s.modules[0])])  # noqa: E731
    group_name = lambda g: short(names[id(g.modules[0])])  # noqa: E731

    def hook(kind, of=state_name):
        def wrap(orig):
            def run(self, *args, **kwargs):
                log.events.append((kind, of(self)))
                return orig(self, *args, **kwargs)
            return run
        return wrap

    def pre_backward(orig):
        def run(self, grad):
            queued = self.ctx.callback_queued
            log.events.append(("pre-backward", state_name(self)))
            at = len(log.events)
            out = orig(self, grad)
            if not queued and self.ctx.callback_queued:
                log.events.insert(at, ("queue the final callback",))
            return out
        return run

    def end_of_backward(orig):
        def run(self):
            log.events.append(("final callback",))
            return orig(self)
        return run

    def owned(orig):
        def run(self, *args, **kwargs):
            with log.owned(group_name(self)):
                return orig(self, *args, **kwargs)
        return run

    def post_backward(orig):
        return hook("post-backward", group_name)(owned(orig))

    def wait_for_unshard(orig):
        def run(self):
            if self._gathered is not None:
                log.events.append(("copy-out", group_name(self)))
            return orig(self)
        return run

    def to_sharded(orig):
        def run(self):
            if self.is_unsharded:
                log.events.append(("free", group_name(self)))
            return orig(self)
        return run

    with patched((FSDPState, "pre_forward", hook("pre-forward")), (FSDPState, "post_forward", hook("post-forward")),
                 (FSDPState, "_pre_backward", pre_backward), (FSDPState, "_end_of_backward", end_of_backward),
                 (FSDPParamGroup, "unshard", owned), (FSDPParamGroup, "wait_for_unshard", wait_for_unshard),
                 (FSDPParamGroup, "to_sharded", to_sharded), (FSDPParamGroup, "post_backward", post_backward)):
        model = TinyGPT(seed=0)
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        names.update({id(m): n for n, m in model.named_modules()})
        return _train(model, log, rank, world)


def _fsdp2_torch(rank, world, mesh):
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState

    log = Log()
    name = lambda group: short(group._module_fqn or "")  # noqa: E731

    def hook(kind, owning=False):
        def wrap(orig):
            def run(self, *args, **kwargs):
                log.events.append((kind, name(self) if isinstance(self, FSDPParamGroup)
                                   else name(self._fsdp_param_groups[0])))
                with log.owned(name(self)) if owning else contextlib.nullcontext():
                    return orig(self, *args, **kwargs)
            return run
        return wrap

    def owned(orig):
        def run(self, *args, **kwargs):
            with log.owned(name(self)):
                return orig(self, *args, **kwargs)
        return run

    def wait_for_unshard(orig):
        def run(self):
            if self._all_gather_result is not None:
                log.events.append(("copy-out", name(self)))
            return orig(self)
        return run

    def to_sharded(orig):
        def run(self):
            if not self.is_sharded:
                log.events.append(("free", name(self)))
            return orig(self)
        return run

    def final_callback(orig):
        def run(self):
            log.events.append(("final callback",))
            return orig(self)
        return run

    def queue(orig):
        def run(self):
            queued = self._state_ctx.post_backward_final_callback_queued
            out = orig(self)
            if not queued:
                log.events.append(("queue the final callback",))
            return out
        return run

    model = TinyGPT(seed=0)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    with patched((FSDPParamGroup, "pre_forward", hook("pre-forward")),
                 (FSDPParamGroup, "post_forward", hook("post-forward")),
                 (FSDPState, "_pre_backward", hook("pre-backward")),
                 (FSDPParamGroup, "post_backward", hook("post-backward", owning=True)),
                 (FSDPParamGroup, "unshard", owned), (FSDPParamGroup, "wait_for_unshard", wait_for_unshard),
                 (FSDPParamGroup, "_to_sharded", to_sharded),
                 (FSDPState, "_root_post_backward_final_callback", final_callback),
                 (FSDPState, "_register_root_post_backward_final_callback", queue)):
        return _train(model, log, rank, world)


def fsdp2_steps() -> dict:
    """{"ours": [events of each step], "torch": [collectives and copy-outs of each step]} on this rank."""
    from torch.distributed.device_mesh import init_device_mesh

    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    return {"ours": _fsdp2_ours(rank, world, mesh), "torch": _fsdp2_torch(rank, world, mesh)}


def both_steps() -> dict:
    """Every recording, in one spawn."""
    return {"fsdp1": fsdp1_steps(), "fsdp2": fsdp2_steps()}
