"""Task 4.2: the auto-wrap policy that shards a Hugging Face model by its transformer layers.

* 4.2 :func:`layer_wrap_policy`: the policy FSDP asks, module by module, "look inside?" and
  "make this a unit?".  Given ``transformer_layer_cls={BertLayer}`` it must make each
  ``BertLayer`` of all-MiniLM-L6-v2 a unit and leave the embeddings and the pooler to the root,
  exactly as torch's ``torch.distributed.fsdp.wrap.transformer_auto_wrap_policy``.

The task text and hints are in ``exercises/README_hf.md``.  Grade with::

    pytest tests/exercises/test_hf_exercises.py --impl=student

Reference solution: ``minifsdp.fsdp.core.wrap.transformer_auto_wrap_policy`` (read it after you are done).
"""

from __future__ import annotations

import torch.nn as nn


def layer_wrap_policy(module: nn.Module, recurse: bool, nonwrapped_numel: int,
                      transformer_layer_cls: set[type]) -> bool:
    """Task 4.2.  FSDP's question about ``module``, answered for a layer-class policy.

    Args:
        module: the module FSDP is looking at (it walks the model from the root down).
        recurse: True when FSDP asks "should I look inside ``module``?", False when it asks
            "should ``module`` become its own FSDP unit?" (asked after its children were visited).
        nonwrapped_numel: parameters of ``module`` not yet in a unit (unused by this policy, but
            every policy receives it: the size-based policy decides with it).
        transformer_layer_cls: the layer classes to wrap, e.g. ``{BertLayer}`` or ``{GPT2Block}``.

    Returns:
        The answer to the question ``recurse`` selects.
    """
    raise NotImplementedError("Task 4.2: layer_wrap_policy -- see exercises/README_hf.md")
