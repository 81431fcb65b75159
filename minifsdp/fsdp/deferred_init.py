"""Deferred initialisation (a model built on the meta device) and ``sync_module_states``, as torch FSDP1.

A model too big for one rank cannot be built whole and then sharded.  Build it on
the ``meta`` device instead (shapes, no bytes) and let FSDP make it real one unit at
a time, just before that unit is flattened and sharded:

    with torch.device("meta"):
        model = TinyGPT(cfg)                         # 0 bytes
    model = FSDP(model, auto_wrap_policy=policy, param_init_fn=fn)

    wrap order (post-order: children first)   what this rank holds afterwards
      blocks.0: fn(Block), fn(ln1), ...  ->     flatten, keep shard 0 of blocks.0
      blocks.1: fn(Block), fn(ln1), ...  ->     + shard of blocks.1
      root:     fn(TinyGPT), fn(tok_emb) ... -> + shard of the root's own tensors

So the most a rank ever holds is its shards of the units done so far plus one
unit's full parameters (twice, for the moment the flat parameter is concatenated).

Which modules ``param_init_fn`` is called on (torch's ``_materialize_with_param_init_fn``):
only when one of the unit's own parameters or buffers is still meta; then on the
unit's module and every submodule not inside a nested unit (or an ignored module),
breadth first, whether or not that submodule has meta tensors itself.  With no
``param_init_fn``, each of those modules that has tensors of its own gets
``to_empty(device=..., recurse=False)`` then ``reset_parameters()`` (torch's
``_materialize_meta_module``).  What we add: a tensor still meta afterwards is an
error that names the module and the tensor (torch does not name them), and a
``reset_parameters`` that is missing is named with the way out.

Note (tied weights): ``to_empty`` makes a *new* parameter for every meta one, so
``lm_head.weight is tok_emb.weight`` stops being true if ``fn`` calls ``to_empty`` on
both modules; torch then flattens two copies that train apart, and so do we (same
flat parameter as torch's), with a warning that names both.  A ``fn`` that keeps a
tie sets the new parameter on every module that shared the meta one:
:func:`tinygpt_param_init_fn` does.

Note (sync_module_states): torch FSDP1 refuses it on CPU (it broadcasts only GPU
tensors: "requires them to be on GPU"); ours works on any device the group's backend
sends.  Each unit broadcasts its own parameters and buffers from rank 0 as it is
wrapped (after materialising, before flattening), so no rank needs more than that
unit in full.  The ranks first compare the number, shapes and dtypes of what they
are about to broadcast: a mismatch is an error on every rank that names the tensor,
never a hang or a broadcast into the wrong bytes.
"""

from __future__ import annotations

import collections
import copy
import hashlib
import warnings
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from minifsdp.fsdp.checks import broadcast_from_rank0, check_one_device, collective_device
from minifsdp.fsdp.core.units import flattened_params, is_unit

__all__ = ["materialize", "modules_to_materialize", "meta_tensor_names", "sync_module_states",
           "tinygpt_param_init_fn"]


def _own_tensors(m: nn.Module):
    yield from ((n, t) for n, t in m._parameters.items() if t is not None)
    yield from ((n, t) for n, t in m._buffers.items() if t is not None)


def modules_to_materialize(root: nn.Module, ignored_modules=frozenset()) -> list[tuple[str, nn.Module]]:
    """(name relative to ``root``, module): ``root`` and its submodules breadth first, stopping at nested
    units and ignored modules (torch's ``_get_modules_to_materialize``)."""
    out, seen, queue = [], {id(root)}, collections.deque([("", root)])
    while queue:
        name, m = queue.popleft()
        out.append((name, m))
        for child_name, child in m.named_children():
            if id(child) not in seen and not is_unit(child) and child not in ignored_modules:
                seen.add(id(child))
                queue.append((f"{name}.{child_name}" if name else child_name, child))
    return out


def _own_states(root: nn.Module, ignored_modules, ignored_params):
    """(name, module, tensor) for the unit's own parameters and buffers (none a nested unit has flattened)."""
    managed = flattened_params(root)
    for name, m in modules_to_materialize(root, ignored_modules):
        for attr, t in _own_tensors(m):
            if id(t) not in managed and t not in ignored_params:
                yield f"{name + '.' if name else ''}{attr}", m, t


def meta_tensor_names(root: nn.Module, ignored_modules=frozenset(), ignored_params=frozenset()) -> list[str]:
    """The unit's own tensors still on the meta device, as ``'attn.qkv.weight (Linear)'``."""
    return [f"{n} ({type(m).__name__})" for n, m, t in _own_states(root, ignored_modules, ignored_params) if t.is_meta]


def _shared_slots(mods) -> list[list[str]]:
    """Groups of ``module.attr`` names that hold one and the same meta parameter (a tie)."""
    slots: dict[int, list[str]] = {}
    for name, m in mods:
        for attr, p in m._parameters.items():
            if p is not None and p.is_meta:
                slots.setdefault(id(p), []).append(f"{name + '.' if name else ''}{attr}")
    return [names for names in slots.values() if len(names) > 1]


def _lookup(root: nn.Module, qualified: str):
    *path, attr = qualified.split(".")
    return root.get_submodule(".".join(path))._parameters.get(attr)


def materialize(module: nn.Module, param_init_fn: Callable[[nn.Module], None] | None, device_id,
                ignored_modules=frozenset(), ignored_params=frozenset()) -> None:
    """Before ``module`` is flattened: make its meta tensors real, with ``param_init_fn`` or ``reset_parameters``."""
    if param_init_fn is not None and not callable(param_init_fn):
        raise ValueError(f"FSDP: param_init_fn must be callable (it gets each module), got {type(param_init_fn)}")
    own = list(_own_states(module, ignored_modules, ignored_params))
    if not any(t.is_meta for _, _, t in own):
        return
    if not all(t.is_meta for _, _, t in own):  # half real, half meta: one flat parameter lives on one device
        check_one_device(module, [t for _, _, t in own], [])
    mods = modules_to_materialize(module, ignored_modules)
    ties = _shared_slots(mods)
    if param_init_fn is not None:
        for _, m in mods:
            param_init_fn(m)
    else:
        device = _device(device_id)
        with torch.no_grad():
            for name, m in mods:
                if not any(True for _ in _own_tensors(m)):
                    continue  # as torch: only modules with tensors of their own
                if not callable(getattr(m, "reset_parameters", None)):
                    raise AttributeError(
                        f"FSDP: '{name or type(module).__name__}' ({type(m).__name__}) is on the meta device and has "
                        "no reset_parameters() to initialise it; give it one, or pass param_init_fn=fn "
                        "(called on each module: e.g. m.to_empty(device=..., recurse=False), then set its tensors)")
                m.to_empty(device=device, recurse=False)
                m.reset_parameters()
    left = meta_tensor_names(module, ignored_modules, ignored_params)
    if left:
        how = "param_init_fn" if param_init_fn is not None else "reset_parameters()"
        raise RuntimeError(
            f"FSDP: after {how}, the unit wrapping {type(module).__name__} still has tensors on the meta device: "
            f"{', '.join(left[:6])}{' ...' if len(left) > 6 else ''}. Every parameter and buffer must be made real "
            "(e.g. module.to_empty(device=..., recurse=False)) and initialised before it is flattened.")
    for names in ties:
        if len({id(_lookup(module, n)) for n in names}) > 1:
            warnings.warn(f"FSDP: {' and '.join(repr(n) for n in names)} were one (tied) parameter on the meta "
                          "device; after materialising they are separate tensors that will train apart (as in "
                          "torch FSDP1). To keep the tie, set the new parameter on every module that shared it "
                          "(see minifsdp.fsdp.deferred_init.tinygpt_param_init_fn).", stacklevel=4)


def _device(device_id) -> torch.device:
    if device_id is None:
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    return torch.device("cuda", device_id) if isinstance(device_id, int) else torch.device(device_id)


def _shape_digest(t: torch.Tensor) -> int:
    data = repr((tuple(t.shape), str(t.dtype))).encode()
    return int.from_bytes(hashlib.blake2b(data, digest_size=7).digest(), "little")


def sync_module_states(groups, module: nn.Module, params, buffers) -> None:
    """sync_module_states=True for one unit: same shapes on every rank (checked), then rank 0's values."""
    tensors = list(params) + list(buffers)
    names = {id(t): n for n, t in list(module.named_parameters()) + list(module.named_buffers())}
    for group in filter(None, (groups.replicate, groups.shard)):
        device = collective_device(group, like=tensors[0] if tensors else None)
        mine = torch.tensor([len(tensors)] + [_shape_digest(t) for t in tensors], dtype=torch.int64)
        count = torch.tensor([len(tensors), -len(tensors)], dtype=torch.int64, device=device)
        dist.all_reduce(count, op=dist.ReduceOp.MIN, group=group)
        if count[0].item() != -count[1].item():
            raise ValueError(f"FSDP(sync_module_states=True): the ranks' {type(module).__name__} units hold "
                             f"different numbers of parameters and buffers (this rank {len(tensors)}); build the "
                             "same model on every rank")
        lo, hi = mine.to(device, copy=True), mine.to(device, copy=True)
        dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=group)
        dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=group)
        bad = (lo.cpu()[1:] != hi.cpu()[1:]).nonzero().flatten().tolist()
        if bad:
            which = ", ".join(f"{names.get(id(tensors[i]), '?')} (this rank {tuple(tensors[i].shape)} "
                              f"{tensors[i].dtype})" for i in bad[:5])
            raise ValueError(f"FSDP(sync_module_states=True): the ranks' {type(module).__name__} units differ in "
                             f"shape or dtype at {which}; rank 0's values cannot be broadcast into them. Build the "
                             "same model (config) on every rank; only the values may differ")
    broadcast_from_rank0(groups, tensors)


def tinygpt_param_init_fn(model: nn.Module, seed: int = 0, device="cpu") -> Callable[[nn.Module], None]:
    """A ``param_init_fn`` that gives a meta-built TinyGPT exactly ``TinyGPT(model.cfg, seed)``'s weights.

    ``TinyGPT.__init__`` draws, under ``manual_seed(seed)``, each module's default
    ``reset_parameters()`` in construction order, then ``normal_(std=0.02)`` for every
    2-D parameter in ``named_parameters()`` order, zeros for biases.  We replay those
    draws once into one scratch tensor at a time (memory: the largest parameter) and
    keep the generator's state before each 2-D parameter's draw; materialising a module
    then restores that state and draws the same numbers.  The causal mask is rebuilt.
    A tied parameter gets one new tensor, set on every module that shared the meta one.
    The global random state is left as it was.
    """
    states: dict[int, torch.Tensor] = {}
    owners: dict[int, list[tuple[nn.Module, str]]] = {}
    for m in model.modules():
        for attr, p in m._parameters.items():
            if p is not None:
                owners.setdefault(id(p), []).append((m, attr))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for m in model.modules():  # the constructors' default initialisation, replayed on a scratch copy
            if any(p is not None for p in m._parameters.values()) and hasattr(m, "reset_parameters"):
                scratch = copy.deepcopy(m).to_empty(device="cpu", recurse=False)
                scratch.reset_parameters()
                del scratch
        for _, p in model.named_parameters():
            if p.dim() >= 2:
                states[id(p)] = torch.get_rng_state()
                torch.empty(p.shape).normal_(std=0.02)
    block_size = model.cfg.block_size
    mask = torch.tril(torch.ones(block_size, block_size, dtype=torch.bool)).view(1, 1, block_size, block_size)

    def init(module: nn.Module) -> None:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            for attr, p in list(module._parameters.items()):
                if p is None or not p.is_meta:
                    continue
                new = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=device), requires_grad=p.requires_grad)
                if id(p) in states:
                    torch.set_rng_state(states[id(p)])
                    new.normal_(std=0.02)
                elif attr == "bias":
                    new.zero_()
                else:  # LayerNorm's weight
                    new.fill_(1.0)
                for m, name in owners[id(p)]:
                    m._parameters[name] = new
            for attr, b in list(module._buffers.items()):
                if b is not None and b.is_meta:
                    if attr != "causal_mask":
                        raise ValueError(f"tinygpt_param_init_fn: unknown buffer {attr!r} of {type(module).__name__}")
                    module._buffers[attr] = mask.clone().to(device)

    return init
