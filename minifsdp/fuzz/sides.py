"""The two sides a fuzz program runs on: torch's FSDP and ours, behind torch's own names.

A program is torch user code.  It passes torch's enums, configs, wrap policies and mixed-precision classes on
both sides, exactly as a torch user would; only the classes a user imports to shard are swapped::

    side      FSDP1 class                         fully_shard            ShardedGradScaler
    torch     torch.distributed.fsdp.FSDP         torch's fully_shard    torch's
    ours      minifsdp.FSDP                       minifsdp.fully_shard   minifsdp's

So code written for torch that fails on ours is a difference the fuzzer reports, not a fixture to adapt.
This module also builds what a program's wrapping needs once per spawn (HYBRID's process groups, the meshes),
because a new process group per program would cost seconds and leak.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
import torch.nn as nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    apply_activation_checkpointing,
    checkpoint_wrapper,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import (
    BackwardPrefetch,
    CPUOffload,
    CPUOffloadPolicy,
    MixedPrecision,
    MixedPrecisionPolicy,
    ShardingStrategy,
)
from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler as TorchScaler
from torch.distributed.fsdp.wrap import ModuleWrapPolicy, size_based_auto_wrap_policy, transformer_auto_wrap_policy
from torch.distributed.tensor import Shard

import minifsdp.fsdp as ours_fsdp1
import minifsdp.fsdp2 as ours_fsdp2
from minifsdp.fuzz.program import Program, block_paths
from minifsdp.fuzz.trees import Block

__all__ = ["SIDES", "Side", "RankContext", "wrap", "DTYPES"]

SIDES = ("torch", "ours")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, None: None}


@dataclasses.dataclass
class Side:
    """The classes a torch user imports to shard, from torch (``name="torch"``) or from minifsdp."""
    name: str
    FSDP: type
    fully_shard: object
    ShardedGradScaler: type

    @classmethod
    def of(cls, name: str) -> Side:
        if name == "torch":
            return cls(name, TorchFSDP, torch_fully_shard, TorchScaler)
        return cls(name, ours_fsdp1.FSDP, ours_fsdp2.fully_shard, ours_fsdp1.ShardedGradScaler)


class RankContext:
    """What every program on this rank shares: HYBRID's (shard, replicate) groups and the device meshes.

    HYBRID at 4 ranks shards over {0, 1} and {2, 3} and replicates over {0, 2} and {1, 3}, as torch's
    intra-node / inter-node split would on two nodes of two GPUs."""

    def __init__(self, collective_timeout_s: float = 30.0):
        self.world, self.rank = dist.get_world_size(), dist.get_rank()
        self._hybrid = self._mesh1 = self._mesh2 = None
        # A program where one rank raises and the others wait in a collective must not wait long; and the two
        # sides must never pair one side's collective with the other's: `settle` meets on a group of its own.
        self.timeout = datetime.timedelta(seconds=collective_timeout_s)
        self.sync = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=10 * collective_timeout_s))
        _short_timeout(None, self.timeout)

    def hybrid_groups(self):
        if self._hybrid is None:
            shard = [dist.new_group([0, 1], timeout=self.timeout), dist.new_group([2, 3], timeout=self.timeout)]
            replicate = [dist.new_group([0, 2], timeout=self.timeout), dist.new_group([1, 3], timeout=self.timeout)]
            self._hybrid = (shard[self.rank // 2], replicate[self.rank % 2])
        return self._hybrid

    def mesh(self, two_d: bool):
        if two_d:
            if self._mesh2 is None:
                self._mesh2 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
                for i in range(2):
                    _short_timeout(self._mesh2.get_group(i), self.timeout)
            return self._mesh2
        if self._mesh1 is None:
            self._mesh1 = init_device_mesh("cpu", (self.world,))
            _short_timeout(self._mesh1.get_group(0), self.timeout)
        return self._mesh1

    def settle(self, error) -> bool:
        """Meet every rank after a side (on the sync group); True if some rank's error says the process group
        broke (a gloo timeout or a closed connection: a rank raised while others waited in a collective)."""
        broken = error is not None and any(w in error[2] for w in _BROKEN)
        flags = [None] * self.world
        dist.all_gather_object(flags, broken, group=self.sync)
        return any(flags)


# what gloo says when a collective's peer is gone or late: the group is unusable after it
_BROKEN = ("gloo", "Connection closed", "Connection reset", "timed out", "Timed out", "timeout")


def _short_timeout(group, timeout: datetime.timedelta) -> None:
    """torch's private ``_set_pg_timeout`` where this torch has it (2.2 and later); else the group keeps its own."""
    setter = getattr(c10d, "_set_pg_timeout", None)
    if setter is not None:
        setter(timeout, group)


def _mixed_precision_fsdp1(mp: dict | None):
    if mp is None:
        return None
    return MixedPrecision(param_dtype=DTYPES[mp["param_dtype"]], reduce_dtype=DTYPES[mp["reduce_dtype"]],
                          buffer_dtype=DTYPES[mp["buffer_dtype"]],
                          keep_low_precision_grads=mp["keep_low_precision_grads"],
                          cast_forward_inputs=mp["cast_forward_inputs"],
                          cast_root_forward_inputs=mp["cast_root_forward_inputs"])


def _policy(wrap_spec: dict):
    classes = {"Block": Block, "Linear": nn.Linear, "BatchNorm1d": nn.BatchNorm1d}
    chosen = {classes[c] for c in wrap_spec["classes"]}
    return {"none": lambda: None, "manual": lambda: None,
            "size": lambda: functools.partial(size_based_auto_wrap_policy,
                                              min_num_params=wrap_spec["min_num_params"]),
            "module": lambda: ModuleWrapPolicy(chosen),
            "transformer": lambda: functools.partial(transformer_auto_wrap_policy, transformer_layer_cls=chosen),
            }[wrap_spec["policy"]]()


def wrap_fsdp1(program: Program, side: Side, model: nn.Module, ctx: RankContext):
    """``model`` wrapped as the program says, through ``side``'s FSDP class and torch's keywords."""
    o, w = program.options, program.wrap
    strategy = ShardingStrategy[o["sharding_strategy"]]
    kwargs = dict(sharding_strategy=strategy, use_orig_params=o["use_orig_params"],
                  mixed_precision=_mixed_precision_fsdp1(o["mixed_precision"]),
                  backward_prefetch=BackwardPrefetch[o["backward_prefetch"]] if o["backward_prefetch"] else None,
                  forward_prefetch=o["forward_prefetch"], limit_all_gathers=o["limit_all_gathers"],
                  cpu_offload=CPUOffload(offload_params=True) if o["cpu_offload"] else None,
                  device_id=torch.device("cpu"))
    if "HYBRID" in o["sharding_strategy"]:
        kwargs["process_group"] = ctx.hybrid_groups()
    ignored = [model.get_submodule(p) for p in w["ignored"]]
    if w["policy"] == "manual":
        for path in w["manual"]:
            if path in w["ignored"]:
                continue
            parent, _, name = path.rpartition(".")
            owner = model.get_submodule(parent)
            wrapped = side.FSDP(owner.get_submodule(name), **kwargs)
            if isinstance(owner, nn.ModuleDict):
                owner[name] = wrapped
            else:
                owner._modules[name] = wrapped
    model = side.FSDP(model, auto_wrap_policy=_policy(w), ignored_modules=ignored or None, **kwargs)
    if o.get("ac"):  # torch's recipe for FSDP1: wrap first, then checkpoint the blocks inside the units
        checkpoint_blocks(model, o["ac"])
    return model


def checkpoint_blocks(model: nn.Module, how: str) -> None:
    """torch's ``apply_activation_checkpointing`` on every Block, reentrant or not, as a torch user calls it."""
    impl = CheckpointImpl.REENTRANT if how == "reentrant" else CheckpointImpl.NO_REENTRANT
    apply_activation_checkpointing(model, checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper,
                                                                                  checkpoint_impl=impl),
                                   check_fn=lambda m: isinstance(m, Block))


def wrap_fsdp2(program: Program, side: Side, model: nn.Module, ctx: RankContext):
    """``fully_shard`` on the chosen blocks, then on the root, as torch's FSDP2 examples do."""
    o = program.options
    mp = o["mixed_precision"]
    kwargs = dict(mesh=ctx.mesh(o["mesh"] == "2d"), reshard_after_forward=o["reshard_after_forward"])
    if mp is not None:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=DTYPES[mp["param_dtype"]],
                                                   reduce_dtype=DTYPES[mp["reduce_dtype"]],
                                                   output_dtype=DTYPES[mp["output_dtype"]],
                                                   cast_forward_inputs=mp["cast_forward_inputs"])
    if o["cpu_offload"]:
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=False)
    if o.get("placement") == "shard1":  # a Linear's weight by columns where they divide evenly (torch's rule)
        n = kwargs["mesh"].size(-1)
        kwargs["shard_placement_fn"] = lambda p: Shard(1) if p.ndim == 2 and p.shape[1] % n == 0 else None
    if o.get("ac"):  # torchtitan's order for FSDP2: checkpoint the blocks first, then shard them
        checkpoint_blocks(model, o["ac"])
    units = [model.get_submodule(p) for p in program.wrap["manual"] if p in block_paths(program.model)]
    for unit in units:
        side.fully_shard(unit, **kwargs)
    root_kwargs = dict(kwargs)
    ignored = [p for path in program.wrap.get("ignored", []) for p in model.get_submodule(path).parameters()]
    if ignored:
        root_kwargs["ignored_params"] = set(ignored)
    if root_kwargs["reshard_after_forward"] not in (True, False):  # an int is for inner units only
        root_kwargs["reshard_after_forward"] = True
    side.fully_shard(model, **root_kwargs)
    if program.wrap.get("explicit_prefetch") and len(units) > 1:
        for a, b in zip(units, units[1:]):
            a.set_modules_to_forward_prefetch([b])
            b.set_modules_to_backward_prefetch([a])
    if not o.get("reshard_after_backward", True):
        model.set_reshard_after_backward(False)
    return model


def wrap(program: Program, side: Side, model: nn.Module, ctx: RankContext):
    return (wrap_fsdp1 if program.impl == "fsdp1" else wrap_fsdp2)(program, side, model, ctx)
