"""Auto-wrap policies (chapter 2.5): which submodules become their own FSDP unit.

A policy is ``policy(module, recurse, nonwrapped_numel) -> bool`` (torch's signature),
bound with ``functools.partial``:

    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})
    model = FSDP(TinyGPT(), auto_wrap_policy=policy)

    TinyGPT                       FSDP (root unit: tok_emb, pos_emb, ln_f; lm_head is tied)
      tok_emb, pos_emb      ->      blocks.0 = FSDP(Block)   own unit
      blocks.0, blocks.1            blocks.1 = FSDP(Block)   own unit
      ln_f, lm_head

It is asked twice per module, as in torch: ``recurse=True`` "look inside its children?",
``recurse=False`` "wrap this module?" with ``nonwrapped_numel``, the parameters no wrapped child
has claimed.  The walk is post-order (children first), so a nested unit takes its parameters before
its parent builds its flat parameter.  torch's own policies work here too.
"""

from typing import Callable

import torch.nn as nn

from minifsdp.fsdp.core.units import flattened_params, is_unit


def transformer_auto_wrap_policy(module: nn.Module, recurse: bool, nonwrapped_numel: int,
                                 transformer_layer_cls: set[type]) -> bool:
    """Wrap every instance of the given block classes (e.g. ``{Block}``); always look inside."""
    return recurse or isinstance(module, tuple(transformer_layer_cls))

def recursive_wrap(module: nn.Module, policy: Callable, wrap: Callable[[nn.Module], nn.Module],
                   only_wrap_children: bool = False) -> tuple[nn.Module, int]:
    """Wrap ``module``'s subtree where ``policy`` says so; returns (module or its wrapper, numel wrapped).
    torch's ``_recursive_wrap`` (``torch/distributed/fsdp/wrap.py``), without the modules torch's
    keywords keep out (``minifsdp/fsdp/torch_options.py`` walks with those)."""
    if is_unit(module):
        return module, 0
    taken = flattened_params(module)
    nonwrapped = sum(p.numel() for p in module.parameters() if id(p) not in taken)
    if not policy(module=module, recurse=True, nonwrapped_numel=nonwrapped):
        return module, 0
    wrapped_numel = 0
    for name, child in module.named_children():
        new_child, n = recursive_wrap(child, policy, wrap)
        if new_child is not child:
            setattr(module, name, new_child)
        wrapped_numel += n
    if not only_wrap_children and policy(module=module, recurse=False, nonwrapped_numel=nonwrapped - wrapped_numel):
        return wrap(module), nonwrapped
    return module, wrapped_numel
