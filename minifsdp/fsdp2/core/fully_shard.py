"""What one ``fully_shard`` call does once its arguments are checked (torch's ``_fully_shard.py`` and
``_fsdp_init.py``): take the parameters, shard them as one group, attach the state and its hooks.

Called bottom-up, each block first (its parameters: one group) and the root last (what no block took: embeddings,
final norm), a call takes what no earlier call took below its module: an earlier call's state marks its subtree.
Each parameter is taken once, with every ``(module, name)`` holding it (a tied weight has two), in torch's order
(children before their module, depth first).  Buffers stay as they are, whole on every rank.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from minifsdp.fsdp2.core.param import MixedPrecisionPolicy
from minifsdp.fsdp2.core.param_group import FSDPParamGroup, MeshInfo
from minifsdp.fsdp2.core.plugin import Plugin
from minifsdp.fsdp2.core.state import FSDPState, fsdp_state

__all__ = ["shard_modules", "managed_params"]


def managed_params(modules: tuple[nn.Module, ...], ignored: set[int] = frozenset()):
    """``(params, users)``: the parameters under ``modules`` that no earlier call took and not ``ignored`` (ids),
    each once, in torch's order; ``users[id(p)]``: every ``(module, name)`` holding ``p``."""
    managed, visited = [], set()

    def visit(m: nn.Module) -> None:
        if m not in modules and fsdp_state(m) is not None:
            return  # an earlier call took this subtree
        visited.add(m)
        for child in m.children():
            if child not in visited:
                visit(child)
        managed.append(m)

    for m in modules:
        visit(m)
    params, users = [], {}
    for m in managed:
        for name, p in m._parameters.items():
            if p is None or id(p) in ignored or isinstance(p, DTensor):  # a DTensor: an earlier call's shard
                continue
            if p.dim() == 0:
                raise ValueError(f"fully_shard doesn't support scalar parameters. Change {name} to a 1D tensor with "
                                 "numel equal to 1.")
            if id(p) not in users:
                params.append(p)
            users.setdefault(id(p), []).append((m, name))
    return params, users


def shard_modules(modules: tuple[nn.Module, ...], mesh_info: MeshInfo, *, comm, device: torch.device,
                  mp_policy: MixedPrecisionPolicy, reshard_after_forward: bool | None = None,
                  ignored: set[int] = frozenset(), plugins: list[Plugin] = ()) -> FSDPState:
    """Shard what ``modules`` hold (one group for all of them) over ``mesh_info`` and hook them; the state.

    ``reshard_after_forward``: True frees the full parameters after forward (gathered again in backward), False
    keeps them, None (torch's default) is True except at the root.  ``comm``: the collectives
    (:func:`minifsdp.comm.get_collectives`); ``device``: where gathers and compute run; ``plugins``: what the
    layer above plugs in (:mod:`~minifsdp.fsdp2.core.plugin`)."""
    params, users = managed_params(modules, ignored)
    group = FSDPParamGroup(params, users, modules, mesh_info, mp_policy, reshard_after_forward is not False, comm,
                           device, plugins) if params else None
    return FSDPState(modules, group, mp_policy, auto_reshard=reshard_after_forward is None)
