"""Auto-wrap policies: which submodules become their own FSDP unit.

A policy is a function ``policy(module, recurse, nonwrapped_numel) -> bool``
with torch's signature, bound with ``functools.partial`` as in torch:

    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})
    model = FSDP(TinyGPT(), auto_wrap_policy=policy)

    TinyGPT                       FSDP (root unit: tok_emb, pos_emb, ln_f; lm_head is tied)
      tok_emb, pos_emb      ->      blocks.0 = FSDP(Block)   own unit
      blocks.0, blocks.1            blocks.1 = FSDP(Block)   own unit
      ln_f, lm_head

It is called twice per module, as torch does: ``recurse=True`` asks "look
inside this module's children?", ``recurse=False`` asks "wrap this module?"
with ``nonwrapped_numel``, the parameters not already claimed by a wrapped
child.  The walk is post-order (children first), so a nested unit claims its
parameters before its parent builds its flat parameter.  torch's own policy
functions work here too, since the signature is the same.

Note (a weight tied across units): TinyGPT's ``lm_head.weight is tok_emb.weight``.
Wrap ``lm_head`` on its own and the tie spans two units; :func:`check_ties_across_units`
does what torch FSDP1 does then, with a message torch does not give.
"""

from __future__ import annotations

import functools
import warnings
from typing import Callable

import torch.nn as nn

from minifsdp.fsdp.units import clean_name, is_unit

__all__ = ["size_based_auto_wrap_policy", "transformer_auto_wrap_policy", "recursive_wrap",
           "check_ties_across_units", "check_layer_cls_matches"]


def transformer_auto_wrap_policy(module: nn.Module, recurse: bool, nonwrapped_numel: int,
                                 transformer_layer_cls: set[type]) -> bool:
    """Wrap every instance of the given block classes (e.g. ``{Block}``); always look inside."""
    if recurse:
        return True
    return isinstance(module, tuple(transformer_layer_cls))


def size_based_auto_wrap_policy(module: nn.Module, recurse: bool, nonwrapped_numel: int,
                                min_num_params: int = int(1e8), force_leaf_modules: set[type] | None = None,
                                exclude_wrap_modules: set[type] | None = None) -> bool:
    """Wrap a module once it holds at least ``min_num_params`` not-yet-wrapped parameters.

    As torch: never look inside ``nn.MultiheadAttention`` (its forward reads
    its weights directly), never wrap a bare ``ModuleList`` / ``ModuleDict``
    (they have no forward to hook).
    """
    force_leaf_modules = {nn.MultiheadAttention} if force_leaf_modules is None else force_leaf_modules
    exclude_wrap_modules = {nn.ModuleList, nn.ModuleDict} if exclude_wrap_modules is None else exclude_wrap_modules
    is_large = nonwrapped_numel >= min_num_params
    if recurse:
        return is_large and not isinstance(module, tuple(force_leaf_modules))
    return is_large and not isinstance(module, tuple(exclude_wrap_modules))


def _nonwrapped_numel(module: nn.Module, ignored=frozenset()) -> int:
    skip = {id(p) for m in ignored for p in m.parameters()}
    return sum(p.numel() for p in module.parameters() if not hasattr(p, "_minifsdp_owner")
               and not getattr(p, "_minifsdp_flat", False) and id(p) not in skip)


def recursive_wrap(module: nn.Module, policy: Callable, wrap: Callable[[nn.Module], nn.Module],
                   only_wrap_children: bool = False, ignored=frozenset()) -> tuple[nn.Module, int]:
    """Wrap ``module``'s subtree where ``policy`` says so; returns (module or its wrapper, numel wrapped).

    ``ignored``: modules FSDP leaves alone (``ignored_modules``): never wrapped or looked into,
    their parameters not counted, as torch's ``_recursive_wrap``.
    """
    if is_unit(module) or module in ignored:
        return module, 0
    if only_wrap_children:  # the top call, from FSDP's constructor
        check_layer_cls_matches(module, policy)
    nonwrapped = _nonwrapped_numel(module, ignored)
    if not policy(module=module, recurse=True, nonwrapped_numel=nonwrapped):
        return module, 0
    wrapped_numel = 0
    for name, child in module.named_children():
        new_child, n = recursive_wrap(child, policy, wrap, ignored=ignored)
        if new_child is not child:
            setattr(module, name, new_child)
        wrapped_numel += n
    remainder = nonwrapped - wrapped_numel
    if not only_wrap_children and policy(module=module, recurse=False, nonwrapped_numel=remainder):
        return wrap(module), nonwrapped
    return module, wrapped_numel


def check_layer_cls_matches(module: nn.Module, policy: Callable) -> None:
    """Warn when a ``transformer_auto_wrap_policy`` names a class that no module in ``module`` is.

    torch FSDP1 wraps nothing then, silently: the whole model becomes one unit, every
    parameter is gathered at once and nothing says why memory did not drop (a typo, or
    ``GPT2Block`` given to a BERT).  We wrap the same (nothing) and warn, naming the class.
    A name given as a string (as in accelerate's config files) is refused: ``isinstance``
    needs the class itself (torch fails there with a bare ``TypeError``).
    """
    if not isinstance(policy, functools.partial) or policy.func.__name__ != "transformer_auto_wrap_policy":
        return
    classes = policy.keywords.get("transformer_layer_cls") or ()
    for cls in classes:
        if not isinstance(cls, type):
            raise TypeError(f"transformer_auto_wrap_policy: transformer_layer_cls takes classes, got {cls!r}; "
                            "import the class (e.g. `from transformers.models.bert.modeling_bert import BertLayer`)")
    present = {type(m) for m in module.modules()}
    for cls in classes:
        if not any(issubclass(t, cls) for t in present):
            warnings.warn(f"FSDP: transformer_layer_cls {cls.__module__}.{cls.__qualname__} matches no module of "
                          f"{type(module).__name__}, so nothing is wrapped by it (torch FSDP1 does the same, "
                          "silently): check the class", stacklevel=4)


def _outside_units(module: nn.Module, prefix: str = ""):
    """(name, module) for ``module`` and every submodule not inside a unit."""
    if is_unit(module):
        return
    yield prefix, module
    for name, child in module.named_children():
        yield from _outside_units(child, f"{prefix}.{name}" if prefix else name)


def check_ties_across_units(module: nn.Module, use_orig_params: bool) -> None:
    """Before ``module`` becomes a unit: a parameter of its own that a nested unit already flattened.

    That is a weight tied across units (``lm_head`` wrapped on its own, ``tok_emb`` left
    here).  torch FSDP1 (``_init_utils._get_orig_params``, ``_flat_param.py``):

    * ``use_orig_params=False``: the nested unit puts no mark on the parameter, so this
      unit flattens it again: two copies, equal at the start, each trained by its own
      use's gradient; the tie is broken, silently.  We do the same, and warn.
    * ``use_orig_params=True``: it is marked flattened, so this unit skips it and the
      outer module is left holding the nested unit's 1-D shard: torch fails at the
      forward (``'weight' must be 2-D``).  We refuse here, naming both and the fix.
    """
    names = {id(m): clean_name(n) for n, m in module.named_modules()}
    for prefix, m in _outside_units(module):
        for name, p in m._parameters.items():
            where = getattr(p, "_minifsdp_flattened_at", None)
            if where is None:
                continue
            here = f"{prefix}.{name}" if prefix else name
            owner = names.get(id(where[0]))
            there = f"{owner}.{where[1]}" if owner else where[1]
            fix = (f"wrap the modules that share it in one unit (do not wrap the module of '{there}' on its own), "
                   "or untie them")
            if use_orig_params:
                raise ValueError(
                    f"FSDP(use_orig_params=True): '{here}' is the same parameter as '{there}', which a nested FSDP "
                    f"unit already flattened; a parameter tied across units is not supported (torch FSDP1 fails "
                    f"at the forward with \"'weight' must be 2-D\"). To train it tied, {fix}."
                )
            warnings.warn(
                f"FSDP: '{here}' is the same parameter as '{there}', which a nested FSDP unit already flattened. "
                "As torch FSDP1 (use_orig_params=False), this unit flattens its own copy: the two start equal and "
                f"train apart (the tie is broken). To keep them tied, {fix}.", stacklevel=3)
