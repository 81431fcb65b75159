"""Chapter 5: ``OffloadPolicy`` and ``CPUOffloadPolicy``, FSDP2's offload policy, as torch's.

``fully_shard(module, offload_policy=CPUOffloadPolicy())`` keeps the sharded parameters, their gradients and so
the optimizer state in CPU memory; only the gathered full parameters live on the accelerator, one group at a
time.  The optimizer steps on the CPU::

    CPU:  padded shard ----------------------------------------> .grad (reduced rows) -> optimizer step
             | copied to the device at each all-gather                   ^ copied back after the reduce-scatter
    GPU:  all-gather -> full params -> forward / backward -> full grads -> reduce-scatter

:class:`CPUOffload` plugs in once, after the core cut the shards (``after_shard``,
:mod:`minifsdp.fsdp2.core.plugin`): it moves each shard's storage to the CPU.  The rest follows from where the
storage lives: the core copies each all-gather input to the compute device, and each reduced gradient to its
shard's device.  On a CPU-only machine both are the CPU and the policy changes nothing; ``pin_memory=True`` (the
default, as torch's) needs an accelerator, and is refused without one, as torch's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn as nn

from minifsdp.fsdp2.core import Plugin

__all__ = ["OffloadPolicy", "CPUOffloadPolicy", "CPUOffload"]


@dataclass
class OffloadPolicy:
    """No offloading (torch's default policy object)."""


@dataclass
class CPUOffloadPolicy(OffloadPolicy):
    """Sharded parameters, gradients and optimizer state in CPU memory; ``pin_memory`` as torch's."""

    pin_memory: bool = True


class CPUOffload(Plugin):
    """The plugin for ``CPUOffloadPolicy``: every shard's storage on the CPU (a meta shard moves when it is
    materialized: :mod:`minifsdp.fsdp2.materialize`)."""

    def after_shard(self, group, originals) -> None:
        for p in group.fsdp_params:
            if p.padded_local.is_meta or p.padded_local.device.type == "cpu":
                continue
            p.padded_local = p.padded_local.cpu()
            p.sharded_param = nn.Parameter(p.to_sharded_dtensor(p.local_view(p.padded_local)),
                                           p.sharded_param.requires_grad)
            p.install(p.sharded_param)
