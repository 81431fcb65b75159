"""Project HYBRID_SHARD's gradient reduction (``project-hybrid``), built from ring collectives.

The goal, the oracle and the hints: ``exercises/projects/hybrid/README.md``.  Grade with::

    pytest tests/exercises/projects/test_hybrid.py --impl=student

Write :func:`hybrid_reduce_gradient`; add whatever helpers you like in this file.
"""

from __future__ import annotations

import torch
import torch.distributed as dist  # noqa: F401 - you will need it

from minifsdp.comm.ring import ring_all_gather, ring_all_reduce, ring_reduce_scatter  # noqa: F401 - or your own

__all__ = ["hybrid_reduce_gradient"]


def hybrid_reduce_gradient(full_grad: torch.Tensor, shard_group, replicate_group) -> torch.Tensor:
    """This rank's gradient shard of one FSDP unit, as torch FSDP1 HYBRID_SHARD reduces it.

    Args:
        full_grad: this rank's whole flat gradient of the unit (1-D, unpadded), computed from its own data,
            in the dtype the reduction runs in (``reduce_dtype``).  Do not modify it.
        shard_group: the ranks that split the unit between them (this rank is rank ``s`` of it).
        replicate_group: the ranks that hold the same shard as this one, one per shard group.

    Returns a new 1-D tensor of ``full_grad``'s dtype: shard ``s`` of the gradient averaged over every
    rank of both groups, the numbers torch FSDP1 leaves in the unit's sharded ``flat_param.grad``
    (before it casts them to the parameters' dtype).
    """
    raise NotImplementedError("project-hybrid: hybrid_reduce_gradient -- see exercises/projects/hybrid/README.md")
