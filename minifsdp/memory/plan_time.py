"""Chapter 2.4, at real scale: the time a step cannot beat on a given machine, and which strategy to pick.

A step cannot finish before its arithmetic is done at the GPU's peak rate, nor before its bytes have
crossed the slowest link it uses at that link's peak rate:

    compute  = FLOPs per rank / peak FLOP/s            (6 per weight per token, + attention; x 4/3 with
                                                        activation checkpointing: one more forward)
    network  = sum over collectives of bytes sent / link speed   (inside a node, or between nodes)
    step    >= max(compute, network)                   (the two overlap at best: a lower bound)

FSDP hides its network time only if each unit's collectives travel while another unit computes: the next
unit's all-gather behind this unit's forward, and in the backward the next all-gather plus this unit's
reduce-scatter behind its backward.  :func:`overlap` compares the two for one block.

Note (published peaks, not measurements): the FLOP/s and link speeds below are NVIDIA's published figures
(:data:`GPUS`, each with its source); real kernels reach a fraction of them, and every message also pays a
latency (a ring pays it N - 1 times per collective) that this bound leaves out.  So a real step is slower;
a plan whose lower bound is already too slow will not be saved by tuning.

Note (what "fits" means): the predicted peak at most ``USABLE`` (90%) of the card's published memory.  The
other 10% is an allowance, not a measurement, for what no tensor shows: the CUDA context, NCCL's buffers,
the caching allocator's fragmentation.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from minifsdp.memory.plan import STRATEGIES, Run, bytes_sent, collectives, model_state, peak
from minifsdp.memory.plan_shapes import ModelShape

__all__ = ["GPU", "GPUS", "USABLE", "step_time", "overlap", "fits", "advise", "report", "smallest_world_that_fits"]

USABLE = 0.9


@dataclass(frozen=True)
class GPU:
    """A GPU's published figures: memory (bytes), dense peak FLOP/s, link speeds per GPU and direction (bit/s)."""

    name: str
    memory: float
    fp32_flops: float
    bf16_flops: float
    intra_node_bps: float  # NVLink, per direction (the datasheet's figure is both directions added)
    inter_node_bps: float  # the node's InfiniBand ports divided among its GPUs
    source: str

    def flops(self, precision: str) -> float:
        return self.fp32_flops if precision == "fp32" else self.bf16_flops


GPUS = {
    "h100": GPU("NVIDIA H100 SXM5 80GB", 80e9, 67e12, 989e12, 3600e9, 400e9,
                "NVIDIA H100 Tensor Core GPU datasheet (SXM5): 80 GB, FP32 67 TFLOPS, BF16/FP16 Tensor Core 1,979 "
                "TFLOPS with sparsity (989 dense), NVLink 900 GB/s (450 GB/s each way); NVIDIA DGX H100 user "
                "guide: 8x ConnectX-7 400 Gb/s InfiniBand, one per GPU"),
    "a100": GPU("NVIDIA A100 SXM4 80GB", 80e9, 19.5e12, 312e12, 2400e9, 200e9,
                "NVIDIA A100 Tensor Core GPU datasheet (SXM4 80GB): FP32 19.5 TFLOPS, BF16/FP16 Tensor Core 312 "
                "TFLOPS dense (624 with sparsity), NVLink 600 GB/s (300 GB/s each way); NVIDIA DGX A100 user "
                "guide: 8x ConnectX-6 200 Gb/s HDR InfiniBand for compute, one per GPU"),
    "h200": GPU("NVIDIA H200 SXM 141GB", 141e9, 67e12, 989e12, 3600e9, 400e9,
                "NVIDIA H200 Tensor Core GPU datasheet (SXM): 141 GB, FP32 67 TFLOPS, BF16/FP16 Tensor Core "
                "1,979 TFLOPS with sparsity (989 dense), NVLink 900 GB/s (450 GB/s each way); NVIDIA DGX H200: "
                "8x ConnectX-7 400 Gb/s, one per GPU"),
}


def with_links(gpu: GPU, intra_gbps: float | None = None, inter_gbps: float | None = None) -> GPU:
    """``gpu`` with other link speeds (Gbit/s per GPU, each way), e.g. a cluster on slower Ethernet."""
    for v in (intra_gbps, inter_gbps):
        if v is not None and v <= 0:
            raise ValueError(f"link speeds must be positive Gbit/s, got {v}.")
    return dataclasses.replace(gpu, intra_node_bps=intra_gbps * 1e9 if intra_gbps else gpu.intra_node_bps,
                               inter_node_bps=inter_gbps * 1e9 if inter_gbps else gpu.inter_node_bps,
                               source=gpu.source + ("; link speeds given by the user" if intra_gbps or inter_gbps
                                                    else ""))


def _flops(shape: ModelShape, run: Run) -> float:
    f = shape.matmul_flops(run.batch, run.seq or shape.seq)
    return f * 4 / 3 if run.activation_checkpointing else f


def _seconds(c, gpu: GPU) -> float:
    return 8 * c.bytes_sent / (gpu.inter_node_bps if c.across_nodes else gpu.intra_node_bps)


def step_time(shape: ModelShape, run: Run, gpu: GPU) -> dict[str, float]:
    """{"compute_s", "network_s", "lower_bound_s"} for one step on ``gpu`` (published peaks)."""
    compute = _flops(shape, run) / gpu.flops(run.precision)
    network = sum(_seconds(c, gpu) for c in collectives(shape, run))
    return {"compute_s": compute, "network_s": network, "lower_bound_s": max(compute, network)}


def overlap(shape: ModelShape, run: Run, gpu: GPU) -> dict[str, dict[str, float | bool]]:
    """Whether the collectives hide behind compute, forward and backward: for FSDP's sharded strategies, one
    unit's (the last: a block) gathers and reduce-scatters against that unit's compute; for DDP and NO_SHARD,
    the backward's all-reduces against the whole backward.  Forward is 1/3 of the FLOPs, backward 2/3 (plus
    a recomputed forward with activation checkpointing)."""
    comm = collectives(shape, run)
    if not comm:
        return {}
    flops = shape.unit_flops(run.batch, run.seq or shape.seq, run.wrap)
    replicated = run.strategy in ("DDP", "NO_SHARD")
    unit = len(flops) - 1
    recompute = 1 / 3 if run.activation_checkpointing else 0
    out = {}
    for phase, share in (("forward", 1 / 3), ("backward", 2 / 3 + recompute)):
        wire = sum(_seconds(c, gpu) for c in comm if c.phase == phase and (replicated or c.unit == unit))
        if wire:
            compute = (sum(flops) if replicated else flops[unit]) * share / gpu.flops(run.precision)
            out[phase] = {"communication_s": wire, "compute_s": compute, "hidden": wire <= compute}
    return out


def fits(shape: ModelShape, run: Run, gpu: GPU) -> bool:
    return peak(shape, run)[0] <= USABLE * gpu.memory


def _candidates(run: Run) -> list[Run]:
    out = []
    for s in STRATEGIES:
        if s == "HYBRID_SHARD" and (run.world_size <= run.gpus_per_node or run.world_size % run.gpus_per_node):
            continue
        out.append(dataclasses.replace(run, strategy=s))
    return out


def smallest_world_that_fits(shape: ModelShape, run: Run, gpu: GPU, largest: int = 2**20) -> int | None:
    """The fewest ranks, a power of two, at which FULL_SHARD fits (None: none up to ``largest``)."""
    n = 1
    while n <= largest:
        if fits(shape, dataclasses.replace(run, world_size=n, strategy="FULL_SHARD"), gpu):
            return n
        n *= 2
    return None


def advise(shape: ModelShape, run: Run, gpu: GPU) -> str:
    """One line: the fastest strategy (by the lower bound, then bytes sent) whose peak fits, at this world size."""
    usable = USABLE * gpu.memory
    options = [(step_time(shape, r, gpu)["lower_bound_s"], bytes_sent(shape, r), r) for r in _candidates(run)
               if fits(shape, r, gpu)]
    if options:
        _, _, best = min(options, key=lambda o: (o[0], o[1]))
        p = peak(shape, best)[0]
        return (f"{best.strategy} is the fastest strategy that fits {run.world_size} x {gpu.name.split()[1]}: peak "
                f"{p / 1e9:.1f} GB of {usable / 1e9:.0f} GB usable, step >= "
                f"{step_time(shape, best, gpu)['lower_bound_s']:.3g} s")
    n = smallest_world_that_fits(shape, run, gpu)
    least = peak(shape, dataclasses.replace(run, strategy="FULL_SHARD"))[0]
    if n is None:
        acts = "" if run.activation_checkpointing else " or --activation-checkpointing"
        return (f"does not fit at any world size: FULL_SHARD needs {least / 1e9:.1f} GB per rank here, and "
                f"what stays on each rank (activations, one gathered unit) alone is over {usable / 1e9:.0f} GB; "
                f"lower --batch or --seq{acts}")
    return (f"does not fit {run.world_size} x {gpu.name.split()[1]} with any strategy (FULL_SHARD needs "
            f"{least / 1e9:.1f} GB of {usable / 1e9:.0f} GB usable); the smallest world size that fits is {n} "
            f"(FULL_SHARD)")


def report(shape: ModelShape, run: Run, gpu: GPU) -> dict:
    """Everything ``python -m minifsdp plan`` prints, as one JSON-ready dict (bytes per rank, seconds)."""
    state = model_state(shape, run)
    top, where, parts = peak(shape, run)
    comm = collectives(shape, run)
    kinds: dict[str, dict[str, int]] = {}
    for c in comm:
        k = kinds.setdefault(c.kind, {"count": 0, "bytes": 0})
        k["count"] += 1
        k["bytes"] += c.bytes_sent
    time = step_time(shape, run, gpu)
    return {
        "model": shape.name, "model_source": shape.source, "params": shape.params,
        "units": shape.unit_numels(run.wrap),
        "run": dataclasses.asdict(run) | {"seq": run.seq or shape.seq},
        "gpu": {"name": gpu.name, "memory_bytes": gpu.memory, "peak_flops": gpu.flops(run.precision),
                "intra_node_bits_per_s": gpu.intra_node_bps, "inter_node_bits_per_s": gpu.inter_node_bps,
                "source": gpu.source + " (published figures, not measurements)"},
        "per_rank_bytes": {k: state[k] for k in ("parameters", "gradients", "optimizer_state", "buffers",
                                                 "ddp_buckets")},
        "model_state_bytes_per_rank": state["model_state"],
        "peak_bytes_per_rank": top, "peak_where": where, "peak_breakdown_bytes": parts,
        "bytes_sent_per_rank_per_step": sum(c.bytes_sent for c in comm), "collectives": kinds,
        "compute_s": time["compute_s"], "network_s": time["network_s"],
        "step_time_lower_bound_s": time["lower_bound_s"], "overlap": overlap(shape, run, gpu),
        "fits": top <= USABLE * gpu.memory, "advice": advise(shape, run, gpu),
    }
