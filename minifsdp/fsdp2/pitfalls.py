"""Chapter 6: an optimizer that holds parameters ``fully_shard`` does not train, named with its fix.

torch's ``fully_shard`` trains the parameters it registers *between* steps: one ``nn.Parameter`` wrapping a
``DTensor`` per original weight (chapter 5).  Two other tensors look like parameters at some moment, and an
optimizer built from ``model.parameters()`` at that moment holds them; it then steps tensors that never get a
gradient, and torch says nothing (the loss just does not move):

    the original parameters            before fully_shard:  model.parameters() -> the originals
                                         fully_shard replaces them with sharded DTensors
    the unsharded parameters           between a forward and its backward: the root keeps its full
                                         parameters for the backward (``reshard_after_forward`` is False
                                         for the root), so model.parameters() -> plain full tensors, which
                                         the backward's reshard frees again

FSDP1 has the first case too (``use_orig_params=False`` flattens the originals away), which
``minifsdp.fsdp.checks.install_optimizer_check`` refuses; it does not see FSDP2's tensors.  Here:

* :func:`watch` (one line in ``fully_shard``) marks every original parameter the call replaces, and adds a
  forward hook that marks the unsharded parameters a group leaves on its modules after its forward, with
  their names under the module;
* a process-wide optimizer step pre-hook (installed once) refuses a step whose optimizer holds a marked
  tensor, naming it and the fix.

Note (what it costs): per forward of a sharded module, one ``isinstance`` per parameter of its group; names
are looked up (one walk of the module's parameters) only the first time a group keeps unsharded
parameters, since the unsharded parameter object is made once and reused.
"""

from __future__ import annotations

from torch.distributed.tensor import DTensor
from torch.optim.optimizer import register_optimizer_step_pre_hook

__all__ = ["watch", "REPLACED", "UNSHARDED", "check_optimizer"]

REPLACED = "_minifsdp_fsdp2_replaced"  # on an original parameter: the name fully_shard replaced it under
UNSHARDED = "_minifsdp_fsdp2_unsharded"  # on an unsharded parameter: its name under the module kept unsharded
_STEP_HOOK = []  # the one process-wide optimizer step pre-hook, once installed


def watch(modules, params, users) -> None:
    """Called by ``fully_shard`` once its parameter group exists.

    ``modules``: the module(s) of the call; ``params``: the original parameters it replaced; ``users``: for
    each, by ``id``, the ``(module, attribute name)`` pairs that held it (``fully_shard``'s own).
    """
    if not params:
        return
    names = {id(m): n for n, m in modules[0].named_modules()}
    where = f" of {type(modules[0]).__name__}"
    for p in params:
        owner, attr = users[id(p)][0]
        p.__dict__[REPLACED] = f"'{_name(names, owner, attr)}'{where}"
    holders = [users[id(p)][0] for p in params]
    for module in modules:
        module.register_forward_hook(_mark_unsharded(module, holders))
    _install_step_check()


def _name(names: dict, owner, attr: str) -> str:
    prefix = names.get(id(owner), "")
    return f"{prefix}.{attr}" if prefix else attr


def _mark_unsharded(module, holders: list):
    def hook(_module, _args, _output) -> None:
        unmarked = [(owner, attr) for owner, attr in holders
                    if not isinstance(p := owner._parameters.get(attr), DTensor) and p is not None
                    and UNSHARDED not in p.__dict__]
        if not unmarked:
            return
        names = {id(m): n for n, m in module.named_modules()}
        for owner, attr in unmarked:
            owner._parameters[attr].__dict__[UNSHARDED] = _name(names, owner, attr)
    return hook


def check_optimizer(optimizer, args, kwargs) -> None:
    """The step pre-hook: refuse an optimizer that holds a tensor ``fully_shard`` does not train."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            kind = type(optimizer).__name__
            if REPLACED in p.__dict__:
                raise RuntimeError(
                    f"{kind} holds {p.__dict__[REPLACED]} as it was before fully_shard replaced it with a "
                    "sharded DTensor parameter: the optimizer was built before fully_shard, so it steps a "
                    "tensor that never gets a gradient (torch's fully_shard does the same, silently). Build it "
                    "after sharding: torch.optim.X(model.parameters(), ...) once fully_shard ran on every module.")
            if UNSHARDED in p.__dict__:
                raise RuntimeError(
                    f"{kind} holds the unsharded '{p.__dict__[UNSHARDED]}', which fully_shard registers only from "
                    "a forward to its backward (the root keeps its full parameters for the backward): the "
                    "optimizer was built after a forward and before its backward, so it steps a tensor that "
                    "never gets a gradient and whose storage the backward frees (torch's fully_shard does the "
                    "same, silently). Build the optimizer before the first forward, or call model.reshard() "
                    "first so that model.parameters() gives the sharded parameters again.")


def _install_step_check() -> None:
    if not _STEP_HOOK:
        _STEP_HOOK.append(register_optimizer_step_pre_hook(check_optimizer))
