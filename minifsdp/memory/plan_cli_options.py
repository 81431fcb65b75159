"""``python -m minifsdp plan``'s flags for the choices :mod:`minifsdp.memory.plan_options` checks: ``--impl``,
``--reshard-after-forward``, ``--ac``, ``--offload``; how each is said in ``--help`` and in the text output.

Kept apart from the command's own module so that the command stays about the model, the run's size and the
card; the flags' meaning, the one-line refusals and the words printed live beside the arithmetic they feed.
"""

from __future__ import annotations

from minifsdp.memory.plan_options import options

__all__ = ["add_torch_options", "check_torch_options", "describe_torch_options"]


def add_torch_options(group) -> None:
    """Add the four flags to an ``argparse`` group (their defaults shown by ``--help``)."""
    group.add_argument("--impl", default="fsdp1",
                       help="fsdp1 (FullyShardedDataParallel: one flat parameter per unit, padded once) | fsdp2 "
                            "(fully_shard: each parameter sharded by rows and padded on its own)")
    group.add_argument("--reshard-after-forward", default="true", metavar="true|false|K|torchtitan",
                       help="fsdp2: what each block keeps from its forward to its backward: true frees its gathered "
                            "parameters (all-gathered again in the backward), false keeps them (no second "
                            "all-gather), K keeps 1/K of them (the backward gathers among K ranks, e.g. 8: one "
                            "node), torchtitan is true but the last block kept (it is prefetched at once). The "
                            "root (embeddings, head) is always kept: torch's default (None) for the root")
    group.add_argument("--ac", default="none", metavar="none|full|selective|every-K",
                       help="activation checkpointing: full checkpoints every block (keeps its input); selective "
                            "is torchtitan's op-level policy (keeps the input, every other matmul's output and "
                            "SDPA's output; the rest runs again); every-K checkpoints blocks K, 2K, ... in full")
    group.add_argument("--offload", default="none", metavar="none|params",
                       help="params (or both): torch's CPU offload, CPUOffload(offload_params=True) or "
                            "CPUOffloadPolicy: parameters, gradients and optimizer state in the CPU's memory, "
                            "copied over the host link (PCIe) each step, the optimizer stepping on the CPU. torch "
                            "has no optimizer-only offload")


def check_torch_options(args) -> None:
    """The four flags' values (and ``--activation-checkpointing`` against ``--ac``): ValueError, one line naming
    the flag and the fix.  The strategy is checked against them when each run is made."""
    old, mode = args.activation_checkpointing, str(args.ac).strip().lower()
    if old and mode not in ("none", "full"):
        raise ValueError(f"--activation-checkpointing is --ac full; give one of the two, not it and --ac {args.ac}")
    options("FULL_SHARD", args.impl, args.reshard_after_forward, args.ac, old, args.offload)


def describe_torch_options(r: dict) -> str:
    """The run line's tail (which FSDP, checkpointing, offload) and, under it, what checkpointing keeps and what
    offload puts on the CPU and the host link."""
    run, a = r["run"], r["assumptions"]
    text = ""
    if run["impl"] == "fsdp2":
        text += f", fsdp2 (fully_shard, reshard_after_forward={run['reshard_after_forward']})"
    if run["ac"] != "none":
        text += f", activation checkpointing {run['ac']}"
    if run["offload"] != "none":
        text += ", CPU offload"
    if run["ac"] != "none":
        text += f"\n  checkpointing: {a['activation_checkpointing']}"
    if run["offload"] != "none":
        per_node = r["host_bytes_per_rank"] * min(run["gpus_per_node"], run["world_size"])
        text += (f"\n  CPU offload: parameters, gradients and optimizer state in host memory, "
                 f"{r['host_bytes_per_rank'] / 1e9:,.2f} GB per rank ({per_node / 1e9:,.2f} GB per node, pinned); "
                 f"{r['host_bytes_copied_per_step'] / 1e9:,.2f} GB over the host link per step, "
                 f"{r['host_link_s']:.3g} s at {a['host_link_bits_per_s'] / 1e9:,.0f} Gbit/s "
                 f"({r['gpu']['host_link']}); the optimizer steps on the CPU (its time left out)")
    return text
