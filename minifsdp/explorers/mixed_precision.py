"""Chapter 4.1 (Mixed precision): one unit's casts under ``MixedPrecision``, the bytes they save, the loss they move.

The learner picks ``MixedPrecision(param_dtype, reduce_dtype, buffer_dtype)`` ("none" keeps the original dtype
for that part), N and a model; the explorer answers three questions with the library's own functions:

* **which tensor is in which dtype**, stage by stage, for one unit of FULL_SHARD (``resolve_dtypes``, torch's rule:
  a ``param_dtype`` with no ``reduce_dtype`` reduces in ``param_dtype``; ``predivide_factor`` for the division)::

      fp32 shard --cast--> param_dtype shard --all-gather--> full (param_dtype) --> forward, backward
      fp32 grad shard <--cast-- /(N/f) <-- reduce-scatter (reduce_dtype) <-- /f <-- full grad, cast to reduce_dtype

* **the bytes one rank sends per step**, all-gathers and reduce-scatters, beside the same step in fp32, counted by
  ``minifsdp.memory.plan.collectives`` (exact, padding included) for the chosen model's shape;
* **what it does to the loss**: 4 AdamW steps of the tiny GPT on one process, in fp32 and under these dtypes, as
  FSDP runs them at N = 1 (NO_SHARD: the parameters cast to ``param_dtype`` for the forward and backward, the
  gradient cast to ``reduce_dtype``, then to the fp32 master's; buffers cast by ``cast_buffers``).  It is a
  measurement (a few hundred ms, one thread), equal bitwise to torch FSDP1 at N = 1 under the same
  ``MixedPrecision`` (``tests/test_explorers_more.py``); only the sum over ranks is left out.
"""

from __future__ import annotations

import copy
import functools
import math
import types
from dataclasses import dataclass

import torch

from minifsdp.explorers.panel import live_panel, static_view, with_kernel_line
from minifsdp.explorers.panel import show as show_panel
from minifsdp.fsdp.core.mixed_precision import MixedPrecision, UnitDtypes, cast_buffers, resolve_dtypes
from minifsdp.fsdp.core.strategy import predivide_factor
from minifsdp.memory.plan import Run, collectives
from minifsdp.memory.plan_shapes import PRESETS
from minifsdp.models import GPTConfig, TinyGPT

__all__ = ["DTYPES", "MODELS", "DEFAULT", "STEPS", "Stage", "PrecisionView", "mixed_precision_of", "measure_losses",
           "compute", "format_precision", "fallback", "panel", "show"]

DTYPES = {"none": None, "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
NAMES = {v: k for k, v in DTYPES.items() if v is not None}
MODELS = ("tiny", "gpt2", "llama-7b")  # shapes of minifsdp.memory.plan_shapes.PRESETS
DEFAULT = {"world_size": 4, "param_dtype": "bf16", "reduce_dtype": "fp32", "buffer_dtype": "bf16", "model": "gpt2"}
STEPS = 4  # AdamW steps of the loss measurement


@dataclass(frozen=True)
class Stage:
    """One stage of a unit's step: what tensor, in which dtype, how many bytes (rank 0, one block unit)."""
    where: str
    tensor: str
    dtype: torch.dtype
    numel: int

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


@dataclass(frozen=True)
class PrecisionView:
    """What ``compute`` returns."""
    setting: dict
    dtypes: UnitDtypes
    factors: tuple[float, float]  # (f, N / f)
    stages: list[Stage]
    sent: dict[str, int]  # "all-gather", "reduce-scatter": bytes rank 0 sends per step under the setting
    sent_fp32: dict[str, int]  # the same in fp32
    losses_fp32: list[float]
    losses: list[float]
    max_param_diff: float  # largest |parameter difference| after the steps
    buffers_cast: list[str]  # the tiny GPT's buffers that buffer_dtype cast


def mixed_precision_of(setting: dict) -> MixedPrecision | None:
    """The setting's ``MixedPrecision`` (None when every part is "none": FSDP without one)."""
    dtypes = {k: DTYPES[setting[k]] for k in ("param_dtype", "reduce_dtype", "buffer_dtype")}
    return MixedPrecision(**dtypes) if any(v is not None for v in dtypes.values()) else None


def _one_thread(fn):
    """Run ``fn`` on one thread: the tiny GPT's ops are too small to gain from more, and on a loaded machine more
    threads thrash (measured here: 20-70 ms a step on one thread against 0.1-1.2 s on two)."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        before = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return fn(*args, **kwargs)
        finally:
            torch.set_num_threads(before)
    return wrapper


@functools.lru_cache(maxsize=32)  # the panel asks again for the dtypes it had: a measurement, kept, not redone
@_one_thread
def measure_losses(param_dtype: str, reduce_dtype: str, buffer_dtype: str, steps: int = STEPS):
    """(losses, fp32 master parameters after the steps, names of the buffers cast) of ``steps`` AdamW steps of the
    tiny GPT under the named dtypes ("none" everywhere: fp32), as FSDP runs them at N = 1 (module docstring)."""
    mp = mixed_precision_of({"param_dtype": param_dtype, "reduce_dtype": reduce_dtype, "buffer_dtype": buffer_dtype})
    master = TinyGPT(GPTConfig.tiny(), seed=0)
    tokens = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, master.cfg.vocab_size, (4, master.cfg.block_size + 1), generator=tokens)
               for _ in range(steps)]
    optimizer = torch.optim.AdamW(master.parameters(), lr=1e-2, foreach=False)
    d = resolve_dtypes(mp, torch.float32)
    low = copy.deepcopy(master)  # the gathered copy the forward and backward run in (tied weights stay tied)
    before = cast_buffers([types.SimpleNamespace(module=low, mixed_precision=mp)])
    names = {(id(m), n): f"{mn}.{n}".lstrip(".") for mn, m in low.named_modules() for n in m._buffers}
    pairs = list(zip(master.parameters(), low.parameters(), strict=True))
    losses = []
    for batch in batches:
        for p, q in pairs:
            q.data, q.grad = p.detach().to(d.param), None  # the all-gathered copy in param_dtype
        loss = low(batch[:, :-1], batch[:, 1:])
        loss.backward()
        for p, q in pairs:  # reduce in reduce_dtype (the sum over one rank; f = N / f = 1), then the master's dtype
            p.grad = q.grad.to(d.reduce).to(d.grad)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    params = tuple(p.detach().clone() for p in master.parameters())
    return tuple(losses), params, tuple(sorted(names[k] for k in before))


def _sent(shape, run: Run) -> dict[str, int]:
    out = {"all-gather": 0, "reduce-scatter": 0}
    for c in collectives(shape, run):
        out[c.kind] += c.bytes_sent
    return out


def _setting(setting: dict | None) -> dict:
    s = {**DEFAULT, **(setting or {})}
    for key in ("param_dtype", "reduce_dtype", "buffer_dtype"):
        if s[key] not in DTYPES:
            raise ValueError(f"{key} must be one of {list(DTYPES)}, got {s[key]!r}")
    if s["model"] not in MODELS:
        raise ValueError(f"model must be one of {list(MODELS)}, got {s['model']!r}")
    if not 2 <= int(s["world_size"]) <= 1024:
        raise ValueError(f"N must be 2 to 1024 ranks, got {s['world_size']}")
    return s


def compute(setting: dict | None = None) -> PrecisionView:
    """The casts, bytes and losses for ``setting`` (keys of :data:`DEFAULT`; missing ones take its values)."""
    s = _setting(setting)
    n = int(s["world_size"])
    d = resolve_dtypes(mixed_precision_of(s), torch.float32)
    shape = PRESETS[s["model"]]
    unit = shape.unit_numels()[1]  # the first block's flat parameter
    shard = math.ceil(unit / n)
    stages = [Stage("at rest, what the optimizer steps", "the shard (fp32 master)", d.orig, shard),
              Stage("before the all-gather", "the shard, cast" if d.casts_params else "the shard itself (no cast)",
                    d.param, shard),
              Stage("all-gather, then forward and backward", "the full parameter", d.param, shard * n),
              Stage("backward", "the full gradient", d.param, shard * n),
              Stage("reduce-scatter (/f before, /(N/f) after)", "the full gradient, in reduce_dtype", d.reduce,
                    shard * n),
              Stage("after the reduce-scatter", "the shard's gradient, cast for the optimizer", d.grad, shard)]
    run = Run(n, "FULL_SHARD", precision=NAMES[d.param], reduce_dtype=NAMES[d.reduce])
    losses, params, cast = measure_losses(s["param_dtype"], s["reduce_dtype"], s["buffer_dtype"])
    losses_fp32, params_fp32, _ = measure_losses("none", "none", "none")
    diff = max((a - b).abs().max().item() for a, b in zip(params, params_fp32, strict=True))
    return PrecisionView(s, d, (predivide_factor(n), n / predivide_factor(n)), stages, _sent(shape, run),
                         _sent(shape, Run(n, "FULL_SHARD")), list(losses_fp32), list(losses), diff, list(cast))


def _mb(nbytes: int) -> str:
    return f"{nbytes / 2**20:,.2f} MiB" if nbytes >= 2**20 else f"{nbytes:,} bytes"


def format_precision(view: PrecisionView) -> str:
    """The stages' dtypes, the bytes sent against fp32, and the loss against fp32."""
    s, d = view.setting, view.dtypes
    f, rest = view.factors
    name = lambda dt: NAMES[dt]  # noqa: E731
    lines = [f"MixedPrecision(param_dtype={s['param_dtype']}, reduce_dtype={s['reduce_dtype']}, "
             f"buffer_dtype={s['buffer_dtype']}) on fp32 parameters -> the unit computes in {name(d.param)}, "
             f"reduces in {name(d.reduce)}, steps an {name(d.grad)} gradient; N = {s['world_size']}, FULL_SHARD, "
             f"f = {f:g}, N/f = {rest:g}",
             f"one unit of {s['model']} (its first block), rank 0:",
             f"{'stage':<44}{'tensor':<46}{'dtype':<7}{'bytes':>12}"]
    lines += [f"{st.where:<44}{st.tensor:<46}{name(st.dtype):<7}{st.nbytes:>12,}" for st in view.stages]
    sent, base = view.sent, view.sent_fp32
    lines.append(f"one step, rank 0 sends (minifsdp.memory.plan): all-gathers {_mb(sent['all-gather'])} (fp32: "
                 f"{_mb(base['all-gather'])}), reduce-scatters {_mb(sent['reduce-scatter'])} (fp32: "
                 f"{_mb(base['reduce-scatter'])}); in all {sum(sent.values()) / sum(base.values()):.0%} of fp32's")
    cast = ", ".join(view.buffers_cast) or "none (its only buffers, the causal masks, are bool)"
    lines.append(f"measured, the tiny GPT, {STEPS} AdamW steps on one process: buffers buffer_dtype cast: {cast}")
    lines.append("loss, fp32:        " + "  ".join(f"{x:.6f}" for x in view.losses_fp32))
    lines.append("loss, these dtypes: " + "  ".join(f"{x:.6f}" for x in view.losses))
    worst = max(abs(a - b) for a, b in zip(view.losses, view.losses_fp32, strict=True))
    lines.append(f"largest loss difference {worst:.3g}; largest fp32 master difference after {STEPS} steps "
                 f"{view.max_param_diff:.3g}")
    return "\n".join(lines)


def fallback(setting: dict | None = None) -> str:
    """Print (and return) one setting's casts and losses and the line saying the panel needs a running kernel."""
    return static_view(format_precision(compute(setting)))


def panel():
    """A slider for N, menus for the three dtypes and the model; the stages, the bytes and the losses as text."""
    import ipywidgets as widgets

    controls = {"world_size": widgets.IntSlider(value=DEFAULT["world_size"], min=2, max=64, description="N")}
    for key in ("param_dtype", "reduce_dtype", "buffer_dtype"):
        controls[key] = widgets.Dropdown(options=list(DTYPES), value=DEFAULT[key], description=key.split("_")[0])
    controls["model"] = widgets.Dropdown(options=list(MODELS), value=DEFAULT["model"], description="model")
    return live_panel(controls, lambda setting: print(format_precision(compute(setting))),
                      "Chapter 4.1: MixedPrecision, cast by cast")


def show(setting: dict | None = None) -> None:
    """A notebook cell's call: the panel in a running kernel; the fallback text on a page without one."""
    show_panel(panel, with_kernel_line(format_precision(compute(setting))))
