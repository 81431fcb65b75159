"""The choices of a planned run beyond its strategy, as torch has them: which FSDP, when to reshard, which blocks
to checkpoint, what to keep on the CPU.  Each is read case-insensitively and checked here, so that a plan never
describes a run torch cannot make: a refusal is one line that names the flag and the fix.

    impl                   fsdp1 (``FullyShardedDataParallel``: flat parameters) | fsdp2 (``fully_shard``:
                           per-parameter sharding, :mod:`minifsdp.memory.plan_fsdp2`)
    reshard_after_forward  fsdp2's ``reshard_after_forward``: true | false | k | torchtitan (FSDP1 has it as its
                           strategy: FULL_SHARD frees after forward, SHARD_GRAD_OP keeps)
    ac                     none | full | selective | every-K (:mod:`minifsdp.memory.plan_ac`)
    offload                none | params (both: the same)

Note (what torch offloads): FSDP1's ``CPUOffload(offload_params=True)`` keeps each flat parameter's shard on the
CPU, copies each sharded gradient there after its reduce-scatter (``_cpu_grad``), and so the optimizer, built on
those parameters, steps on the CPU with its state there: parameters, gradients and optimizer state move
together.  ``CPUOffload(offload_params=False)`` offloads nothing, and there is no flag for the optimizer's state
alone (DeepSpeed's ZeRO-Offload has one; torch does not).  FSDP2's ``CPUOffloadPolicy`` moves the same three.
So ``--offload params`` (and ``both``, the same thing) is torch's one offload, and ``optimizer`` is refused.
DDP has no offload at all.
"""

from __future__ import annotations

from minifsdp.memory.plan_ac import parse_ac
from minifsdp.memory.plan_fsdp2 import RESHARD_CHOICES

__all__ = ["IMPLS", "OFFLOADS", "options"]

IMPLS = ("fsdp1", "fsdp2")
OFFLOADS = ("none", "params", "both", "optimizer")
OFFLOADED = ("parameters", "gradients", "optimizer_state")  # what torch's one offload keeps on the CPU


def _reshard(value) -> str:
    text = str(value).strip().lower()
    if text in RESHARD_CHOICES:
        return text
    if text.isdigit() and int(text) >= 1:
        return str(int(text))
    raise ValueError(f"unknown --reshard-after-forward {value!r}; use true (free after forward, gather again in "
                     f"backward), false (keep until backward), a whole number k (keep 1/k, gather among k ranks) "
                     f"or torchtitan (true, but the last block kept)")


def options(strategy: str, impl: str, reshard_after_forward, ac: str, activation_checkpointing: bool,
            offload: str) -> dict:
    """The normalized ``impl``, ``reshard_after_forward``, ``ac`` and ``offload`` of a run, or ValueError (one
    line naming the flag and the fix) when torch has no such run."""
    impl = str(impl).strip().lower()
    if impl not in IMPLS:
        raise ValueError(f"unknown --impl {impl!r}; use fsdp1 (FullyShardedDataParallel) or fsdp2 (fully_shard)")
    reshard = _reshard(reshard_after_forward)
    if impl == "fsdp1" and reshard != "true":
        raise ValueError(f"--reshard-after-forward {reshard} is fully_shard's (give --impl fsdp2); FSDP1 says it "
                         f"by --strategy: FULL_SHARD frees after forward, SHARD_GRAD_OP keeps until backward")
    if impl == "fsdp2" and strategy != "FULL_SHARD":
        fix = {"SHARD_GRAD_OP": "use --reshard-after-forward false",
               "HYBRID_SHARD": "a 2-D mesh is not planned for fsdp2 yet: use --impl fsdp1",
               }.get(strategy, "fully_shard always shards: use --impl fsdp1 for DDP or NO_SHARD")
        raise ValueError(f"--impl fsdp2 takes --strategy FULL_SHARD only (fully_shard on one mesh dimension); "
                         f"for {strategy}, {fix}")
    mode = parse_ac(ac)
    if activation_checkpointing and mode == "none":  # the old flag: every block
        mode = "full"
    off = str(offload).strip().lower()
    if off not in OFFLOADS:
        raise ValueError(f"unknown --offload {offload!r}; use none or params (torch's CPU offload: parameters, "
                         f"gradients and optimizer state on the CPU)")
    if off == "optimizer":
        raise ValueError("--offload optimizer: torch has no optimizer-only offload (that is DeepSpeed's "
                         "ZeRO-Offload); use --offload params: torch's CPUOffload moves parameters, gradients "
                         "and optimizer state together")
    off = "params" if off == "both" else off
    if off == "params" and strategy == "DDP":
        raise ValueError("--offload params: DDP has no CPU offload; use an FSDP --strategy (FULL_SHARD) or "
                         "--offload none")
    return {"impl": impl, "reshard_after_forward": reshard, "ac": mode, "offload": off}
