"""``python -m minifsdp plan``: will it fit, what will it send, how fast can it be, before you pay for the GPUs.

    python -m minifsdp plan --model llama-7b --world-size 64 --precision bf16
    python -m minifsdp plan --model llama-70b --world-size 8,64,512 --strategy all --precision bf16 \\
                            --activation-checkpointing --plot out/plan_70b.png
    python -m minifsdp plan --layers 48 --hidden 6144 --vocab 50257 --params 20e9 --world-size 128 --json

One world size and one strategy: the full plan (bytes per rank by category, the peak and where, bytes per
collective, the time bound and overlap, advice).  Several (``--world-size 8,64,512``, ``--strategy all``):
a table, one row each.  The numbers come from :mod:`minifsdp.memory.plan` (memory and bytes, held to the
byte against measured steps at 2 and 4 ranks by ``tests/test_plan_measured.py``) and
:mod:`minifsdp.memory.plan_time` (published GPU figures).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from minifsdp.memory.plan import STRATEGIES, Run
from minifsdp.memory.plan_shapes import PRESETS, preset, shape_from_args
from minifsdp.memory.plan_time import GPUS, USABLE, report, with_links

__all__ = ["add_arguments", "run_plan"]


def add_arguments(p) -> None:
    p.add_argument("--model", default=None, help=f"a preset: {', '.join(PRESETS)} (or give a shape below)")
    p.add_argument("--layers", type=int, default=None, help="shape: transformer blocks")
    p.add_argument("--hidden", type=int, default=None, help="shape: width")
    p.add_argument("--vocab", type=int, default=32000, help="shape: vocabulary (default 32000)")
    p.add_argument("--heads", type=int, default=None, help="shape: attention heads (default hidden / 128)")
    p.add_argument("--params", type=float, default=None,
                   help="shape: total parameters (e.g. 20e9): sets the MLP's width to match")
    p.add_argument("--arch", default="llama", help="shape: llama (RMSNorm, SwiGLU, untied head) or gpt")
    p.add_argument("--world-size", default="8", help="GPUs, or a list: 8,64,512")
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--strategy", default="FULL_SHARD",
                   help=f"{' | '.join(STRATEGIES[1:])} | ddp, a list, or all")
    p.add_argument("--precision", default="fp32",
                   help="fp32 (torch's default) | bf16 | fp16: MixedPrecision(param_dtype=reduce_dtype=that), the "
                        "sharded fp32 parameters kept as the master copy")
    p.add_argument("--optimizer", default="adamw", help="adamw | sgd (with momentum)")
    p.add_argument("--batch", type=int, default=1, help="sequences per GPU per step")
    p.add_argument("--seq", type=int, default=None, help="tokens per sequence (default: the model's context)")
    p.add_argument("--activation-checkpointing", action="store_true", help="checkpoint every block")
    p.add_argument("--wrap", default="layer", help="layer (one FSDP unit per block) | none (one unit)")
    p.add_argument("--gpu", default="h100", help=f"{' | '.join(GPUS)}: published figures (NVIDIA's datasheets)")
    p.add_argument("--link-gbps", default=None,
                   help="INSIDE,BETWEEN: link speeds per GPU each way, Gbit/s (default: the GPU's published "
                        "NVLink and its node's InfiniBand, e.g. 3600,400 for h100)")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.add_argument("--plot", default=None, help="save a PNG: peak per rank against world size, every strategy")


class PlanError(ValueError):
    """Bad input: one line that names the problem and the fix."""


def _ints(text: str, what: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise PlanError(f"{what} takes whole numbers separated by commas, got {text!r}") from None
    if not values or min(values) < 1:
        raise PlanError(f"{what} must be positive, got {text!r}")
    return values


def _shape(args):
    if args.model is not None:
        if any(v is not None for v in (args.layers, args.hidden, args.params)):
            raise PlanError("give --model or a shape (--layers, --hidden, ...), not both")
        shape = preset(args.model)
        if args.seq and shape.arch == "gpt" and args.seq > shape.seq:
            raise PlanError(f"{shape.name} learns positions for {shape.seq} tokens; --seq {args.seq} is longer "
                            f"(use at most {shape.seq})")
        return shape
    if args.layers is None or args.hidden is None:
        raise PlanError(f"name a model (--model {' | '.join(PRESETS)}) or give its shape: --layers and --hidden "
                        f"(with --params, --vocab, --heads if you know them)")
    if args.arch not in ("llama", "gpt"):
        raise PlanError(f"unknown --arch {args.arch!r}; use llama or gpt")
    return shape_from_args(args.layers, args.hidden, args.vocab, args.heads, args.seq or 4096, args.params, args.arch)


def _runs(args, shape) -> list[Run]:
    sizes = _ints(args.world_size, "--world-size")
    names = STRATEGIES if args.strategy.lower() == "all" else \
        [s.strip().upper() for s in args.strategy.split(",") if s.strip()]
    unknown = [s for s in names if s not in STRATEGIES]
    if unknown:
        raise PlanError(f"unknown strategy {unknown[0]!r}; use {', '.join(STRATEGIES)} (or ddp), a list, or all")
    runs = []
    for n in sizes:
        for s in names:
            if s == "HYBRID_SHARD" and args.strategy.lower() == "all" and (n % args.gpus_per_node or
                                                                           n <= args.gpus_per_node):
                continue  # "all": HYBRID only where there are several whole nodes
            runs.append(Run(world_size=n, strategy=s, precision=args.precision, optimizer=args.optimizer,
                            batch=args.batch, seq=args.seq or 0, activation_checkpointing=args.activation_checkpointing,
                            wrap=args.wrap, gpus_per_node=args.gpus_per_node))
    return runs


def _gpu(args):
    if args.gpu not in GPUS:
        raise PlanError(f"unknown --gpu {args.gpu!r}; known: {', '.join(GPUS)}")
    if args.link_gbps is None:
        return GPUS[args.gpu]
    parts = args.link_gbps.split(",")
    try:
        speeds = [float(v) for v in parts]
    except ValueError:
        speeds = []
    if len(speeds) != 2:
        raise PlanError(f"--link-gbps takes two speeds, inside and between nodes, e.g. 3600,400; "
                        f"got {args.link_gbps!r}")
    return with_links(GPUS[args.gpu], *speeds)


def _gb(b: float) -> str:
    return f"{b / 1e9:,.2f}" if b >= 1e7 else f"{b / 1e3:,.1f} kB" if b >= 1e3 else f"{b:.0f} B"


def _text(r: dict) -> str:
    run, gpu = r["run"], r["gpu"]
    per, parts = r["per_rank_bytes"], r["peak_breakdown_bytes"]
    lines = [f"{r['model']}: {r['params']:,} parameters in {len(r['units'])} FSDP units ({r['model_source']})",
             f"run: {run['world_size']} x {gpu['name']} ({run['gpus_per_node']} per node), {run['strategy']}, "
             f"{run['precision']}, {run['optimizer']}, {run['batch']} x {run['seq']} tokens per GPU"
             + (", activation checkpointing" if run["activation_checkpointing"] else ""),
             "", "per rank, GB (1e9 bytes)  at rest after the optimizer step"]
    for k in ("parameters", "gradients", "optimizer_state", "buffers", "ddp_buckets"):
        if per[k]:
            lines.append(f"  {k.replace('_', ' '):<24} {_gb(per[k]):>10}")
    lines.append(f"  {'model state':<24} {_gb(r['model_state_bytes_per_rank']):>10}   (parameters + gradients + "
                 f"optimizer state: 16 bytes per parameter, sharded, padding and AdamW's step included)")
    lines += ["", f"peak {_gb(r['peak_bytes_per_rank'])} GB per rank, at {r['peak_where']}:"]
    lines += [f"  {k.replace('_', ' '):<24} {_gb(v):>10}" for k, v in parts.items() if v]
    usable = USABLE * gpu["memory_bytes"]
    lines.append(f"  {'fits' if r['fits'] else 'does NOT fit'} in {_gb(usable)} GB ({USABLE:.0%} of the card's "
                 f"published {_gb(gpu['memory_bytes'])} GB)")
    lines += ["", f"sent per rank per step: {_gb(r['bytes_sent_per_rank_per_step'])} GB"]
    lines += [f"  {k:<16} {v['count']:>5} x  {_gb(v['bytes']):>10}" for k, v in r["collectives"].items()]
    lines += ["", f"step >= {r['step_time_lower_bound_s']:.3g} s: compute {r['compute_s']:.3g} s at "
                  f"{gpu['peak_flops'] / 1e12:,.0f} TFLOP/s, network {r['network_s']:.3g} s at "
                  f"{gpu['intra_node_bits_per_s'] / 1e9:,.0f} / {gpu['inter_node_bits_per_s'] / 1e9:,.0f} Gbit/s "
                  f"inside / between nodes (published peaks: {gpu['name']})"]
    for phase, o in r["overlap"].items():
        what = "its collectives" if run["strategy"] in ("DDP", "NO_SHARD") else "a block's collectives"
        lines.append(f"  {phase}: {what} take {o['communication_s'] * 1e3:.3g} ms against "
                     f"{o['compute_s'] * 1e3:.3g} ms of compute: {'hidden' if o['hidden'] else 'NOT hidden'}")
    lines += ["", f"advice: {r['advice']}"]
    return "\n".join(lines)


def _table(reports: list[dict]) -> str:
    head = f"{'N':>6} {'strategy':<14} {'state GB':>9} {'peak GB':>9} {'fits':>5} {'sent GB':>9} {'step >= s':>10}" \
           f"  peak at"
    lines = [head]
    for r in reports:
        lines.append(f"{r['run']['world_size']:>6} {r['run']['strategy']:<14} "
                     f"{r['model_state_bytes_per_rank'] / 1e9:>9.2f} {r['peak_bytes_per_rank'] / 1e9:>9.2f} "
                     f"{'yes' if r['fits'] else 'no':>5} "
                     f"{r['bytes_sent_per_rank_per_step'] / 1e9:>9.2f} {r['step_time_lower_bound_s']:>10.3g}  "
                     f"{r['peak_where']}")
    first = reports[0]
    for n in dict.fromkeys(r["run"]["world_size"] for r in reports):  # the same advice for every row of one N
        lines.append(f"N = {n}: {next(r['advice'] for r in reports if r['run']['world_size'] == n)}")
    lines.append(f"(per rank; {first['gpu']['name']}, {first['run']['precision']}, {first['run']['batch']} x "
                 f"{first['run']['seq']} tokens per GPU; fits: peak <= {USABLE:.0%} of "
                 f"{first['gpu']['memory_bytes'] / 1e9:.0f} GB)")
    return "\n".join(lines)


def plot(reports: list[dict], path: str | None = None, ax=None, title: str = ""):
    """Peak (solid) and model state (dashed) per rank against world size, one colour per strategy, and the
    card's usable memory; saved to ``path`` (a PNG) or drawn on ``ax``.  Returns the Figure."""
    import matplotlib

    if ax is None:
        matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2)) if ax is None else (ax.figure, ax)
    for i, s in enumerate(STRATEGIES):
        rows = sorted((r for r in reports if r["run"]["strategy"] == s), key=lambda r: r["run"]["world_size"])
        if not rows:
            continue
        n = [r["run"]["world_size"] for r in rows]
        ax.plot(n, [r["peak_bytes_per_rank"] / 1e9 for r in rows], "o-", color=f"C{i}", label=f"{s}: peak")
        ax.plot(n, [r["model_state_bytes_per_rank"] / 1e9 for r in rows], "--", color=f"C{i}", alpha=0.6)
    gpu = reports[0]["gpu"]
    usable = USABLE * gpu["memory_bytes"] / 1e9
    ax.axhline(usable, color="k", linewidth=0.8)
    ax.text(0.01, usable, f" {USABLE:.0%} of {gpu['name'].split()[1]}'s {gpu['memory_bytes'] / 1e9:.0f} GB",
            transform=ax.get_yaxis_transform(), fontsize="small", va="bottom")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("world size (GPUs)")
    ax.set_ylabel("GB per GPU (dashed: model state)")
    ax.set_title(title or f"{reports[0]['model']}: predicted peak per GPU")
    ax.legend(fontsize="x-small")
    if path:
        fig.tight_layout()
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=120)
        plt.close(fig)
    return fig


def run_plan(args) -> int:
    try:
        shape = _shape(args)
        gpu = _gpu(args)
        reports = [report(shape, run, gpu) for run in _runs(args, shape)]
    except ValueError as e:  # PlanError, and the library's own checks (HYBRID's node size, a bad shape)
        print(f"minifsdp plan: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(reports[0] if len(reports) == 1 else {"rows": reports}, indent=1))
    else:
        print(_text(reports[0]) if len(reports) == 1 else _table(reports))
    if args.plot:
        plot(reports, args.plot)
        if not args.json:
            print(f"saved {args.plot}")
    return 0
