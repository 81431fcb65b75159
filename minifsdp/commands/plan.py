"""``python -m minifsdp plan``: will it fit, what will it send, how fast can it be, before you pay for the GPUs.

    python -m minifsdp plan --model llama-7b --world-size 64 --precision bf16
    python -m minifsdp plan --model llama-70b --world-size 8,64,512 --strategy all --precision bf16 \\
                            --activation-checkpointing --plot out/plan_70b.png
    python -m minifsdp plan --hf-config path/to/config.json --gpu h100-96 --reduce-dtype fp32 --json
    python -m minifsdp plan --model llama-7b --world-size 64 --impl fsdp2 --reshard-after-forward 8 --ac selective

One world size and one strategy: the full plan (bytes per rank by category, the peak and where, bytes per
collective, the time bound, what it assumes, advice).  Several (``--world-size 8,64,512``, ``--strategy all``):
a table, one row each.  The numbers come from :mod:`minifsdp.memory.plan` (memory and bytes, held to the
byte against measured steps at 2 and 4 ranks by ``tests/test_plan_measured.py``) and
:mod:`minifsdp.memory.plan_time` (the cards' published figures, :mod:`minifsdp.memory.gpus`).

Bad input is one line naming the flag and the fix (exit status 2), never a default used in silence; names
(models, cards, strategies, dtypes) are case-insensitive; a plan's cost does not grow with the world size.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from minifsdp.memory.gpus import GPUS, gpu, with_links, with_memory
from minifsdp.memory.hf_config import shape_from_hf_config
from minifsdp.memory.plan import LOW_PRECISION, OPTIMIZERS, STRATEGIES, Run
from minifsdp.memory.plan_cli_options import add_torch_options, check_torch_options, describe_torch_options
from minifsdp.memory.plan_shapes import PRESETS, preset, shape_from_args
from minifsdp.memory.plan_time import USABLE, report

__all__ = ["PARSER_OPTIONS", "add_arguments", "run_plan"]


class _Formatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The examples as written, and each option's default where it has one."""

    def _get_help_string(self, action):
        if action.default in (None, False, argparse.SUPPRESS):
            return action.help
        return super()._get_help_string(action)


PARSER_OPTIONS = dict(
    formatter_class=_Formatter,
    description="Will a model fit, what will each GPU send, how fast can a step be: memory per GPU by category "
                "(the peak and where in the step), bytes per collective, a lower bound on the step time from the "
                "card's published peaks, the assumptions behind it, and the fastest strategy that fits (or, when "
                "none does, the changes that would). Describe the model by a preset, its shape, or a Hugging Face "
                "config.json; the run by world size, strategy, precision, batch and sequence per GPU, and card.",
    epilog="examples:\n"
           "  python -m minifsdp plan --model llama-7b --world-size 64 --precision bf16\n"
           "  python -m minifsdp plan --model llama-70b --world-size 8,64,512 --strategy all --precision bf16 "
           "--activation-checkpointing\n"
           "  python -m minifsdp plan --hf-config config.json --gpu h100-96 --precision bf16 --reduce-dtype fp32 "
           "--batch 2 --seq 8192 --json")


def add_arguments(p) -> None:
    m = p.add_argument_group("the model: a preset, a Hugging Face config, or a shape")
    m.add_argument("--model", default=None, help=f"a preset: {', '.join(PRESETS)}")
    m.add_argument("--hf-config", default=None, metavar="FILE",
                   help="a Hugging Face config.json (model_type llama, mistral, qwen2 or gpt2)")
    m.add_argument("--layers", type=int, default=None, help="shape: transformer blocks")
    m.add_argument("--hidden", type=int, default=None, help="shape: width")
    m.add_argument("--vocab", type=int, default=None, help="shape: vocabulary (default 32000)")
    m.add_argument("--heads", type=int, default=None, help="shape: attention heads (default hidden / 128)")
    m.add_argument("--kv-heads", type=int, default=None,
                   help="shape: key/value heads, grouped-query attention (llama; default: as many as --heads)")
    m.add_argument("--ffn", type=int, default=None,
                   help="shape: the MLP's inner width (default: llama 8/3 x hidden rounded up to 256, gpt 4 x hidden)")
    m.add_argument("--params", type=float, default=None,
                   help="shape: total parameters (e.g. 20e9): sets the MLP's width (--ffn) to match")
    m.add_argument("--tied-embeddings", action="store_true", help="shape: the head shares the embedding (llama)")
    m.add_argument("--arch", default="llama", help="shape: llama (RMSNorm, SwiGLU, untied head) or gpt")
    r = p.add_argument_group("the run")
    r.add_argument("--world-size", default="8", help="GPUs, or a list: 8,64,512")
    r.add_argument("--gpus-per-node", type=int, default=8, help="GPUs joined by the fast link (NVLink)")
    r.add_argument("--strategy", default="FULL_SHARD", help=f"{' | '.join(STRATEGIES[1:])} | ddp, a list, or all")
    r.add_argument("--precision", default="fp32",
                   help="fp32 (torch's default) | bf16 | fp16: MixedPrecision(param_dtype=that), the sharded fp32 "
                        "parameters kept as the master copy")
    r.add_argument("--reduce-dtype", default=None,
                   help="fp32 | bf16 | fp16: MixedPrecision's reduce_dtype, the gradients on the wire (default: "
                        "--precision); fp32 under bf16 also holds an fp32 copy of each unit's gradient")
    r.add_argument("--optimizer", default="adamw",
                   help=" | ".join(f"{k} ({v[0]} bytes per parameter: {v[1]})" for k, v in OPTIMIZERS.items()))
    r.add_argument("--batch", type=int, default=1, help="sequences per GPU per step")
    r.add_argument("--seq", type=int, default=None, help="tokens per sequence (default: the model's context)")
    r.add_argument("--activation-checkpointing", action="store_true", help="checkpoint every block (--ac full)")
    add_torch_options(r)
    r.add_argument("--wrap", default="layer", help="layer (one FSDP unit per block) | none (one unit)")
    g = p.add_argument_group("the card")
    g.add_argument("--gpu", default="h100", help=f"{' | '.join(GPUS)}: published figures (vendors' datasheets)")
    g.add_argument("--gpu-memory", type=float, default=None, metavar="GB",
                   help="the card's memory in GB (10^9 bytes), in place of its published one")
    g.add_argument("--link-gbps", default=None,
                   help="INSIDE,BETWEEN: link speeds per GPU each way, Gbit/s (default: the card's published "
                        "NVLink and its node's network, e.g. 3600,400 for h100)")
    o = p.add_argument_group("output")
    o.add_argument("--json", action="store_true", help="print JSON instead of text")
    o.add_argument("--plot", default=None, help="save a PNG: peak per rank against world size, every strategy")


class PlanError(ValueError):
    """Bad input: one line that names the problem and the fix."""


POSITIVE = {"layers": "transformer blocks", "hidden": "the model's width", "vocab": "tokens in the vocabulary",
            "heads": "attention heads", "kv_heads": "key/value heads", "ffn": "the MLP's inner width",
            "batch": "sequences per GPU", "seq": "tokens per sequence", "gpus_per_node": "GPUs per node"}
DEFAULTS = {"seq": "leave it out for the model's context", "batch": "the default is 1",
            "gpus_per_node": "the default is 8"}


def _check(args) -> None:
    """Every number in range and every name known, before any arithmetic: one line naming the flag and the fix."""
    for field, what in POSITIVE.items():
        v = getattr(args, field)
        if v is not None and v < 1:
            flag = "--" + field.replace("_", "-")
            fix = DEFAULTS.get(field, "leave it out for its default")
            raise PlanError(f"{flag} is {what}: give a positive whole number, got {v} ({fix})")
    if args.params is not None and not args.params > 0:
        raise PlanError(f"--params is the model's parameter count: give a positive number (e.g. 7e9), got "
                        f"{args.params}")
    for flag, v in (("--precision", args.precision), ("--reduce-dtype", args.reduce_dtype)):
        if v is not None and v.lower() not in LOW_PRECISION:
            raise PlanError(f"unknown {flag} {v!r}; use {', '.join(LOW_PRECISION)}")
    if args.optimizer.lower() not in OPTIMIZERS:
        raise PlanError(f"--optimizer {args.optimizer!r} is not modelled; use {' or '.join(OPTIMIZERS)} "
                        f"(adamw: 16 bytes per parameter, sgd with momentum: 12)")
    if args.wrap.lower() not in ("layer", "none"):
        raise PlanError(f"unknown --wrap {args.wrap!r}; use layer (one FSDP unit per block) or none (one unit)")
    check_torch_options(args)


def _ints(text: str, what: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise PlanError(f"{what} takes whole numbers separated by commas, got {text!r}") from None
    if not values or min(values) < 1:
        raise PlanError(f"{what} must be positive, got {text!r}")
    return values


SHAPE_FLAGS = ("layers", "hidden", "vocab", "heads", "kv_heads", "ffn", "params")


def _shape(args, warnings: list[str]):
    given = [f"--{k.replace('_', '-')}" for k in SHAPE_FLAGS if getattr(args, k) is not None]
    given += ["--tied-embeddings"] if args.tied_embeddings else []
    if args.model is not None or args.hf_config is not None:
        if args.model is not None and args.hf_config is not None:
            raise PlanError("give --model or --hf-config, not both")
        if given:
            raise PlanError(f"give --model / --hf-config or a shape ({', '.join(given)}), not both")
        try:
            shape = preset(args.model) if args.model is not None else shape_from_hf_config(args.hf_config)
        except ValueError as e:
            raise PlanError(str(e)) from None
        if args.seq and shape.arch == "mlp":
            raise PlanError(f"--seq has no meaning for {shape.name}, an MLP: it takes --batch samples; leave --seq out")
        if args.seq and args.seq > shape.seq:
            if shape.arch == "gpt":
                raise PlanError(f"{shape.name} learns positions for {shape.seq} tokens; --seq {args.seq} is "
                                f"longer (use at most {shape.seq})")
            warnings.append(f"--seq {args.seq} is past {shape.name}'s context of {shape.seq} tokens (it was "
                            f"trained on at most that); planned as asked")
        return shape
    if args.layers is None or args.hidden is None:
        raise PlanError(f"name a model (--model {' | '.join(PRESETS)}, or --hf-config FILE) or give its shape: "
                        f"--layers and --hidden (with --params or --ffn, --vocab, --heads, --kv-heads if you know "
                        f"them)")
    arch = args.arch.lower()
    if arch not in ("llama", "gpt"):
        raise PlanError(f"unknown --arch {args.arch!r}; use llama or gpt")
    try:
        return shape_from_args(args.layers, args.hidden, args.vocab or 32000, args.heads, args.seq or 4096,
                               args.params, arch, args.ffn, args.kv_heads, args.tied_embeddings)
    except ValueError as e:
        raise PlanError(str(e).replace(" the hidden size", " --hidden").replace("key/value heads", "--kv-heads")) \
            from None


def _runs(args, shape) -> list[Run]:
    sizes = _ints(args.world_size, "--world-size")
    every = args.strategy.lower() == "all"
    names = STRATEGIES if every else [s.strip().upper() for s in args.strategy.split(",") if s.strip()]
    if every and args.impl.lower() == "fsdp2":  # fully_shard on one mesh dimension: FULL_SHARD's layout
        names = ("FULL_SHARD",)
    unknown = [s for s in names if s not in STRATEGIES]
    if unknown:
        raise PlanError(f"unknown --strategy {unknown[0]!r}; use {', '.join(STRATEGIES)} (any case), a list, or all")
    runs = []
    for n in sizes:
        for s in names:
            if s == "HYBRID_SHARD" and every and (n % args.gpus_per_node or n <= args.gpus_per_node):
                continue  # "all": HYBRID only where there are several whole nodes
            if s == "DDP" and every and args.offload.lower() != "none":
                continue  # "all": DDP has no CPU offload
            runs.append(Run(world_size=n, strategy=s, precision=args.precision, reduce_dtype=args.reduce_dtype or "",
                            optimizer=args.optimizer, batch=args.batch, seq=args.seq or 0,
                            activation_checkpointing=args.activation_checkpointing, wrap=args.wrap.lower(),
                            gpus_per_node=args.gpus_per_node, impl=args.impl, ac=args.ac, offload=args.offload,
                            reshard_after_forward=args.reshard_after_forward))
    return runs


def _gpu(args):
    card = gpu(args.gpu)
    if args.gpu_memory is not None:
        card = with_memory(card, args.gpu_memory)
    if args.link_gbps is None:
        return card
    parts = args.link_gbps.split(",")
    try:
        speeds = [float(v) for v in parts]
    except ValueError:
        speeds = []
    if len(speeds) != 2:
        raise PlanError(f"--link-gbps takes two speeds, inside and between nodes, e.g. 3600,400; "
                        f"got {args.link_gbps!r}")
    if min(speeds) <= 0:
        raise PlanError(f"--link-gbps takes positive speeds in Gbit/s, e.g. 3600,400; got {args.link_gbps!r}")
    return with_links(card, *speeds)


def _gb(b: float) -> str:
    return f"{b / 1e9:,.2f}" if b >= 1e7 else f"{b / 1e3:,.1f} kB" if b >= 1e3 else f"{b:.0f} B"


def _text(r: dict) -> str:
    run, gpu = r["run"], r["gpu"]
    per, parts = r["per_rank_bytes"], r["peak_breakdown_bytes"]
    lines = [f"{r['model']}: {r['params']:,} parameters in {len(r['units'])} FSDP units ({r['model_source']})",
             f"run: {run['world_size']} x {gpu['name']} ({run['gpus_per_node']} per node), {run['strategy']}, "
             f"{run['precision']}" + (f" (gradients reduced in {run['reduce_dtype']})"
                                      if run["reduce_dtype"] != run["precision"] else "")
             + f", {run['optimizer']}, {run['batch']} x {run['seq']} tokens per GPU"
             + describe_torch_options(r),
             "", "per rank, GB (1e9 bytes)  at rest after the optimizer step"
             + ("  (the model state in the CPU's memory)" if run["offload"] != "none" else "")]
    for k in ("parameters", "gradients", "optimizer_state", "buffers", "ddp_buckets"):
        if per[k]:
            lines.append(f"  {k.replace('_', ' '):<24} {_gb(per[k]):>10}")
    per_param, why = OPTIMIZERS[run["optimizer"]]
    lines.append(f"  {'model state':<24} {_gb(r['model_state_bytes_per_rank']):>10}   ({per_param} bytes per "
                 f"parameter, sharded, padding included; {why})")
    lines += ["", f"peak {_gb(r['peak_bytes_per_rank'])} GB per rank, at {r['peak_where']}:"]
    lines += [f"  {k.replace('_', ' '):<24} {_gb(v):>10}" for k, v in parts.items() if v]
    usable = USABLE * gpu["memory_bytes"]
    lines.append(f"  {'fits' if r['fits'] else 'does NOT fit'} in {_gb(usable)} GB ({USABLE:.0%} of the card's "
                 f"published {_gb(gpu['memory_bytes'])} GB)")
    lines += ["", f"sent per rank per step: {_gb(r['bytes_sent_per_rank_per_step'])} GB"]
    lines += [f"  {k:<16} {v['count']:>5} x  {_gb(v['bytes']):>10}" for k, v in r["collectives"].items()]
    a = r["assumptions"]
    lines += ["", f"step >= {r['step_time_lower_bound_s']:.3g} s: compute {r['compute_s']:.3g} s at "
                  f"{gpu['peak_flops'] / 1e12:,.1f} TFLOP/s, network {r['network_s']:.3g} s at "
                  f"{gpu['intra_node_bits_per_s'] / 1e9:,.0f} / {gpu['inter_node_bits_per_s'] / 1e9:,.0f} Gbit/s "
                  f"inside / between nodes" + (f", host link {r['host_link_s']:.3g} s" if r["host_link_s"] else "")
                  + f" (published peaks: {gpu['name']})",
              f"  assumed: {a['flops_per_step']:.4g} FLOPs per step, {a['flops_per_token']:.4g} per token "
              f"({a['flops_formula']}; {a['matmul_parameters']:,} matmul parameters), at the {run['precision']} dense "
              f"peak; overlap {a['overlap']}; latency {a['latency']}"]
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
    a = first["assumptions"]
    lines.append(f"(step >= max(compute, network): {a['flops_per_step']:.4g} FLOPs per GPU per step at "
                 f"{a['peak_flops'] / 1e12:,.1f} TFLOP/s, bytes at {a['intra_node_bits_per_s'] / 1e9:,.0f} / "
                 f"{a['inter_node_bits_per_s'] / 1e9:,.0f} Gbit/s inside / between nodes; perfect overlap, no "
                 f"latency)")
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
    warnings: list[str] = []
    try:
        _check(args)
        shape = _shape(args, warnings)
        card = _gpu(args)
        reports = [report(shape, run, card) | {"warnings": warnings} for run in _runs(args, shape)]
    except ValueError as e:  # PlanError, and the library's own checks (HYBRID's node size, a bad shape)
        print(f"minifsdp plan: error: {e}", file=sys.stderr)
        return 2
    for w in warnings:
        print(f"minifsdp plan: warning: {w}", file=sys.stderr)
    if args.json:
        print(json.dumps(reports[0] if len(reports) == 1 else {"rows": reports}, indent=1))
    else:
        print(_text(reports[0]) if len(reports) == 1 else _table(reports))
    if args.plot:
        plot(reports, args.plot)
        if not args.json:
            print(f"saved {args.plot}")
    return 0
