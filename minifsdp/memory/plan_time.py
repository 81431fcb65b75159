"""Chapter 2.4, at real scale: the time a step cannot beat on a given machine, and which strategy to pick.

A step cannot finish before its arithmetic is done at the GPU's peak rate, nor before its bytes have
crossed the slowest link it uses at that link's peak rate:

    compute  = FLOPs per rank / peak FLOP/s            (6 per weight per token, + attention; + what activation
                                                        checkpointing runs again: minifsdp.memory.plan_ac)
    network  = sum over collectives of bytes sent / link speed   (inside a node, or between nodes)
    host     = bytes CPU offload copies / host link    (PCIe, per card: minifsdp.memory.gpus)
    step    >= max(compute, network, host)             (they overlap at best: a lower bound)

FSDP hides its network time only if each unit's collectives travel while another unit computes: the next
unit's all-gather behind this unit's forward, and in the backward the next all-gather plus this unit's
reduce-scatter behind its backward.  :func:`overlap` compares the two for one block.

Note (published peaks, not measurements): the FLOP/s and link speeds are the vendors' published figures
(:data:`GPUS`, in :mod:`minifsdp.memory.gpus`, each with its source); real kernels reach a fraction of them,
and every message also pays a latency (a ring pays it N - 1 times per collective) that this bound leaves out.
So a real step is slower; a plan whose lower bound is already too slow will not be saved by tuning.
:func:`assumptions` says all of this beside every plan, with the FLOP count it used.

Note (advice in numbers): when no strategy fits, :func:`advise` names the changes that would, each found by
doubling then bisection on the plan itself (the peak grows with batch and sequence and falls with N):
checkpointing alone and its peak, the largest batch (or sequence), the smallest world size of any size.

Note (what "fits" means): the predicted peak at most ``USABLE`` (90%) of the card's published memory.  The
other 10% is an allowance, not a measurement, for what no tensor shows: the CUDA context, NCCL's buffers,
the caching allocator's fragmentation.
"""

from __future__ import annotations

import dataclasses

from minifsdp.memory.gpus import GPU, GPUS, with_links
from minifsdp.memory.plan import STRATEGIES, Run, bytes_sent, collectives, model_state, peak
from minifsdp.memory.plan_ac import recompute_flops, saved_ops
from minifsdp.memory.plan_shapes import ModelShape

__all__ = ["GPU", "GPUS", "USABLE", "with_links", "step_time", "overlap", "fits", "advise", "assumptions", "report",
           "smallest_world_that_fits", "largest_that_fits"]

USABLE = 0.9


def _flops(shape: ModelShape, run: Run) -> float:
    seq = run.seq or shape.seq
    return shape.matmul_flops(run.batch, seq) + recompute_flops(shape, run.ac, run.batch, seq)


def host_copies(shape: ModelShape, run: Run) -> int:
    """Bytes CPU offload copies over the host link per step (0 without it): each shard to the GPU for every
    all-gather that starts from the shards (fp32, as stored; an int ``reshard_after_forward``'s backward gathers
    from pieces kept on the GPU), each reduced gradient shard back (fp32, padded).  Unsharded (NO_SHARD, one
    rank): each unit in once, its gradient out once."""
    if not run.offloaded:
        return 0
    if run.shard_size == 1:
        return 2 * 4 * shape.params
    return sum(4 * c.numel // c.group_size for c in collectives(shape, run)
               if c.kind == "reduce-scatter" or (c.kind == "all-gather" and c.group_size == run.shard_size))


def _seconds(c, gpu: GPU) -> float:
    return 8 * c.bytes_sent / (gpu.inter_node_bps if c.across_nodes else gpu.intra_node_bps)


def step_time(shape: ModelShape, run: Run, gpu: GPU) -> dict[str, float]:
    """{"compute_s", "network_s", "host_link_s", "lower_bound_s"} for one step on ``gpu`` (published peaks).
    With CPU offload the host link's copies are a third bound: they run on their own copy engines beside the
    collectives and the compute, so at best they overlap both (the CPU's optimizer step is left out)."""
    compute = _flops(shape, run) / gpu.flops(run.precision)
    network = sum(_seconds(c, gpu) for c in collectives(shape, run))
    host = 8 * host_copies(shape, run) / gpu.host_bps if run.offloaded else 0.0
    return {"compute_s": compute, "network_s": network, "host_link_s": host,
            "lower_bound_s": max(compute, network, host)}


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
    seq = run.seq or shape.seq
    base = shape.matmul_flops(run.batch, seq)
    recompute = recompute_flops(shape, run.ac, run.batch, seq) / base if base else 0
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
    if run.impl == "fsdp2":  # fully_shard on one mesh dimension: its reshard setting is the user's
        return [run]
    out = []
    for s in STRATEGIES:
        if s == "DDP" and run.offloaded:  # DDP has no CPU offload
            continue
        if s == "HYBRID_SHARD" and (run.world_size <= run.gpus_per_node or run.world_size % run.gpus_per_node):
            continue
        out.append(dataclasses.replace(run, strategy=s))
    return out


def _first_true(test, lo: int, hi: int) -> int:
    """The smallest k in (lo, hi] with ``test(k)``, given ``test(hi)`` and not ``test(lo)`` (bisection)."""
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if test(mid) else (mid, hi)
    return hi


def smallest_world_that_fits(shape: ModelShape, run: Run, gpu: GPU, largest: int = 2**40) -> int | None:
    """The fewest ranks, any whole number, at which FULL_SHARD fits (None: none up to ``largest``): doubling to
    the first power of two that fits, then bisecting below it.  The peak falls as N grows except for a unit's
    padding (a few bytes), so the answer fits and the world size one below it does not."""
    reshard = "true" if run.reshard_after_forward.isdigit() else run.reshard_after_forward  # k need not divide n

    def ok(n):
        return fits(shape, dataclasses.replace(run, world_size=n, strategy="FULL_SHARD",
                                               reshard_after_forward=reshard), gpu)

    n = 1
    while n <= largest and not ok(n):
        n *= 2
    if n > largest:
        return None
    return n if n == 1 else _first_true(ok, n // 2, n)


def largest_that_fits(shape: ModelShape, run: Run, gpu: GPU, field: str = "batch", largest: int = 2**30) -> \
        tuple[int, str]:
    """(the largest ``batch`` or ``seq`` at which some strategy fits at this world size, that strategy, the
    fastest of those that reach it); (0, "") when even 1 does not.  The peak grows with both: doubling, then
    bisection."""
    best = (0, 0.0, "")
    for r in _candidates(run):
        def ok(v, r=r):
            return fits(shape, dataclasses.replace(r, **{field: v}), gpu)

        if not ok(1):
            continue
        lo, hi = 1, 2
        while hi < largest and ok(hi):
            lo, hi = hi, 2 * hi
        hi = min(hi, largest)
        v = hi if ok(hi) else _first_true(lambda k: not ok(k), lo, hi) - 1
        best = max(best, (v, -step_time(shape, dataclasses.replace(r, **{field: v}), gpu)["lower_bound_s"],
                          r.strategy))
    return best[0], best[2]


def _fits_somehow(shape: ModelShape, run: Run, gpu: GPU) -> tuple[float, str] | None:
    """(the least peak among the strategies that fit, its strategy), or None."""
    ok = [(peak(shape, r)[0], r.strategy) for r in _candidates(run) if fits(shape, r, gpu)]
    return min(ok) if ok else None


def advise(shape: ModelShape, run: Run, gpu: GPU) -> str:
    """One line: the fastest strategy (by the lower bound, then bytes sent) whose peak fits, at this world size;
    when none fits, the changes that would, with numbers: checkpointing alone, the largest batch (or sequence),
    the smallest world size."""
    usable = USABLE * gpu.memory
    card = gpu.name.split()[1]
    options = [(step_time(shape, r, gpu)["lower_bound_s"], bytes_sent(shape, r), r) for r in _candidates(run)
               if fits(shape, r, gpu)]
    if options:
        _, _, best = min(options, key=lambda o: (o[0], o[1]))
        p = peak(shape, best)[0]
        return (f"{best.strategy} is the fastest strategy that fits {run.world_size} x {card}: peak "
                f"{p / 1e9:.1f} GB of {usable / 1e9:.0f} GB usable, step >= "
                f"{step_time(shape, best, gpu)['lower_bound_s']:.3g} s")
    least = peak(shape, dataclasses.replace(run, strategy="FULL_SHARD"))[0]
    changes = []
    if not run.activation_checkpointing:
        ckpt = _fits_somehow(shape, dataclasses.replace(run, activation_checkpointing=True), gpu)
        if ckpt:
            changes.append(f"--activation-checkpointing alone fits ({ckpt[1]}, peak {ckpt[0] / 1e9:.1f} GB)")
    batch, strategy = largest_that_fits(shape, run, gpu, "batch")
    if batch:
        changes.append(f"the largest --batch that fits is {batch} ({strategy})")
    else:
        seq, strategy = largest_that_fits(shape, dataclasses.replace(run, batch=1), gpu, "seq", run.seq or shape.seq)
        changes.append(f"--batch 1 --seq {seq} fits ({strategy})" if seq else
                       f"at {run.world_size} ranks not even one token per GPU fits")
    n = smallest_world_that_fits(shape, run, gpu)
    if n is None:
        if not run.activation_checkpointing:
            m = smallest_world_that_fits(shape, dataclasses.replace(run, activation_checkpointing=True), gpu)
            if m is not None:
                changes.append(f"with --activation-checkpointing the smallest world size that fits is {m} "
                               f"(FULL_SHARD)")
        return (f"does not fit at any world size: FULL_SHARD needs {least / 1e9:.1f} GB per rank here, and "
                f"what stays on each rank (activations, one gathered unit) alone is over {usable / 1e9:.0f} GB; "
                + "; ".join(changes))
    return (f"does not fit {run.world_size} x {card} with any strategy (FULL_SHARD needs {least / 1e9:.1f} GB "
            f"of {usable / 1e9:.0f} GB usable); the smallest world size that fits is {n} (FULL_SHARD); "
            + "; ".join(changes))


def assumptions(shape: ModelShape, run: Run, gpu: GPU) -> dict:
    """What the time bound assumes, to print beside it: the FLOP count and its formula, the peak rates, the
    overlap, the latency left out, what "fits" allows."""
    mlp = shape.arch == "mlp"  # an MLP's "tokens" are its samples, and it has no attention
    tokens = run.batch * (1 if mlp else run.seq or shape.seq)
    flops = _flops(shape, run)
    return {
        "flops_per_step": flops, "flops_per_token": flops / tokens, "tokens_per_step_per_gpu": tokens,
        "matmul_parameters": shape.matmul_params(),
        "flops_formula": ("6 x matmul parameters x samples" if mlp else
                          "6 x matmul parameters x tokens + 12 x layers x seq x hidden x tokens (attention)")
                         + {"none": "", "full": ", x 4/3 (activation checkpointing: the forward again)",
                            "selective": ", + 2 x the recomputed matmuls' weights x tokens (selective checkpointing)"
                            }.get(run.ac, f", + 1/3 of each checkpointed block's ({run.ac}: its forward again)"),
        "activation_checkpointing": saved_ops(shape, run.ac),
        "host_link_bits_per_s": gpu.host_bps if run.offloaded else 0.0,
        "peak_flops": gpu.flops(run.precision), "peak_flops_dtype": run.precision,
        "intra_node_bits_per_s": gpu.intra_node_bps, "inter_node_bits_per_s": gpu.inter_node_bps,
        "overlap": f"perfect: step >= max(compute, network{', host link' if run.offloaded else ''}), compute and "
                   f"communication fully overlapped",
        "latency_s": 0.0, "latency": "left out (each ring step also pays a message latency, N - 1 per collective)",
        "usable_memory_fraction": USABLE,
    }


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
                "host_link_bits_per_s": gpu.host_bps, "host_link": gpu.host_link,
                "source": gpu.source + " (published figures, not measurements)"},
        "per_rank_bytes": {k: state[k] for k in ("parameters", "gradients", "optimizer_state", "buffers",
                                                 "ddp_buckets")},
        "model_state_bytes_per_rank": state["model_state"],
        "peak_bytes_per_rank": top, "peak_where": where, "peak_breakdown_bytes": parts,
        "bytes_sent_per_rank_per_step": sum(c.bytes_sent for c in comm), "collectives": kinds,
        "compute_s": time["compute_s"], "network_s": time["network_s"], "host_link_s": time["host_link_s"],
        "host_bytes_per_rank": state["host"], "host_bytes_copied_per_step": host_copies(shape, run),
        "step_time_lower_bound_s": time["lower_bound_s"], "overlap": overlap(shape, run, gpu),
        "fits": top <= USABLE * gpu.memory, "advice": advise(shape, run, gpu),
        "assumptions": assumptions(shape, run, gpu),
    }
