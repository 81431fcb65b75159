"""Project ZeRO-1 (``project-zero1``): each rank keeps the optimizer state of 1/N of the parameters.

The goal, the oracle and the hints: ``exercises/projects/zero1/README.md``.  Grade with::

    pytest tests/exercises/projects/test_zero1.py --impl=student

Write :class:`Zero1`; add whatever helpers you like in this file.
"""

from __future__ import annotations

import torch
import torch.distributed as dist  # noqa: F401 - you will need it

__all__ = ["Zero1"]


class Zero1:
    """An optimizer for a plain (unwrapped) model replicated on every rank of ``group``.

    ``Zero1(model.parameters(), torch.optim.AdamW, group=None, lr=1e-2, weight_decay=0.1)``: one parameter
    group; ``optimizer_class`` and ``**defaults`` build the optimizer that updates this rank's part.
    ``step()`` runs after every rank's ``loss.backward()`` on its own data: afterwards every rank holds the
    same parameters, those one optimizer step on the gradient averaged over the ranks would give.
    """

    def __init__(self, params, optimizer_class: type[torch.optim.Optimizer], group=None, **defaults):
        raise NotImplementedError("project-zero1: Zero1.__init__ -- see exercises/projects/zero1/README.md")

    def step(self) -> None:
        raise NotImplementedError("project-zero1: Zero1.step -- see exercises/projects/zero1/README.md")

    def zero_grad(self, set_to_none: bool = True) -> None:
        raise NotImplementedError("project-zero1: Zero1.zero_grad -- see exercises/projects/zero1/README.md")
