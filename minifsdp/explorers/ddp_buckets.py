"""Chapter 1.2 (What DistributedDataParallel does): which gradients share a bucket, and what overlapping them buys.

The learner picks the tiny GPT's size, ``bucket_cap_mb`` and N; the explorer cuts the buckets by torch's rule with
the library's own function (``minifsdp.ddp.buckets.fill_buckets``): parameters visited in reverse registration
order (torch's guess at the order the backward makes the gradients ready), a bucket closed once it holds at least
its cap, the first bucket's cap torch's ``first_bucket_bytes_cap``::

    bucket_cap_mb = 0.02 (given)     caps [20,971 bytes]                      every bucket the same cap
    bucket_cap_mb left at default    caps [1 MiB, 25 MiB]                     a small first bucket, sent early

(torch: ``BucketCapacityConfig`` in ``torch/nn/parallel/distributed.py``; after the first backward its
``Reducer::rebuild_buckets`` cuts the buckets with these caps, in the order the gradients were seen to become
ready, which on the tiny GPT groups the same parameters as reverse registration order.)

Then it prices each bucket's all-reduce with the ring of chapter 2.2 (``ring_time.ring_cost``: the library's
ring schedule in the alpha-beta model) and lays out one step in time, a **model**, not a measurement: the
backward's time (a setting) is split over the buckets in proportion to their bytes; bucket k's all-reduce starts
once its last gradient is ready and the all-reduce before it is done (DDP launches buckets in order)::

    backward     [ bucket 0's grads ][ bucket 1's grads ][ bucket 2's grads ]
    all-reduce                       [ b0 ]              [ b1 ]              [ b2 ]   <- only b2 waits after

Beside it, the same step with one all-reduce of every gradient after the backward, and with one per parameter:
the two ends that buckets sit between (latency paid once, no overlap; overlap, latency paid 28 times).
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass

from minifsdp.ddp.buckets import fill_buckets
from minifsdp.explorers.panel import live_panel, static_view, with_kernel_line
from minifsdp.explorers.panel import show as show_panel
from minifsdp.explorers.ring_time import ring_cost
from minifsdp.models import GPTConfig, TinyGPT

__all__ = ["MODELS", "CAPS_MB", "BACKWARD_MS", "DEFAULT", "MiB", "FIRST_BUCKET_BYTES", "DEFAULT_CAP_MB", "torch_caps",
           "Bucket", "BucketView", "timeline", "compute", "format_buckets", "fallback", "draw", "panel", "show"]

MODELS = {"tiny": GPTConfig.tiny, "mini": GPTConfig.mini, "small": GPTConfig.small}
MiB = 2**20  # torch's bucket_cap_mb counts MiB (_MB_TO_BYTES)
DEFAULT_CAP_MB = 25  # torch's _DEFAULT_BUCKET_CAP_MB, the cap when bucket_cap_mb is left at None
FIRST_BUCKET_BYTES = 2**20  # torch's dist._DEFAULT_FIRST_BUCKET_BYTES: the first bucket's cap at the default
CAPS_MB = (0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 25, "default")  # the slider's stops
BACKWARD_MS = (0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 50, 100)  # the backward's time, the slider's stops
DEFAULT = {"bucket_cap_mb": 0.02, "world_size": 4, "model": "tiny", "backward_ms": 0.5, "alpha_us": 10.0,
           "bandwidth_gbps": 10.0}


def torch_caps(bucket_cap_mb) -> list[int]:
    """The bytes at which torch's DDP closes its 1st, 2nd, ... bucket (the last cap repeats).

    ``"default"`` (or None) is ``bucket_cap_mb`` left out: 25 MiB, the first bucket 1 MiB.  A given cap is used
    for every bucket, the first included (torch sets ``first_bucket_bytes_cap`` to it)."""
    if bucket_cap_mb in (None, "default"):
        return [FIRST_BUCKET_BYTES, DEFAULT_CAP_MB * MiB]
    try:
        cap = int(float(bucket_cap_mb) * MiB)
    except (TypeError, ValueError):
        cap = 0
    if cap <= 0:
        raise ValueError(f"bucket_cap_mb must be positive (or 'default'), got {bucket_cap_mb!r}")
    return [cap]


@dataclass(frozen=True)
class Bucket:
    """One bucket: its parameters (in the order they join it), bytes, and its place in the modelled step."""
    index: int
    params: list[str]
    nbytes: int
    allreduce_s: float  # the ring's time in the alpha-beta model
    ready_s: float  # its last gradient ready (the backward's time split by bytes)
    start_s: float  # its all-reduce starts: ready, and the one before it done
    end_s: float


@dataclass(frozen=True)
class BucketView:
    """What ``compute`` returns: the setting, the caps torch would use, the buckets, and two steps to compare."""
    setting: dict
    config: GPTConfig
    caps: list[int]
    buckets: list[Bucket]
    backward_s: float
    one_message_s: float  # one all-reduce of every gradient, after the backward
    per_parameter_s: float  # one all-reduce per parameter, overlapped the same way

    @property
    def step_s(self) -> float:
        """The backward and every all-reduce done (the model's step without the optimizer)."""
        return max(self.backward_s, self.buckets[-1].end_s)

    @property
    def total_bytes(self) -> int:
        return sum(b.nbytes for b in self.buckets)


def timeline(sizes: list[int], backward_s: float, n: int, alpha: float, beta: float) -> list[tuple[float, ...]]:
    """(all-reduce time, ready, start, end) of each bucket of ``sizes`` bytes, in launch order (the model above)."""
    total, done_bytes, last_end, out = sum(sizes), 0, 0.0, []
    for size in sizes:
        done_bytes += size
        ready = backward_s * done_bytes / total
        seconds = ring_cost(size, n, alpha, beta).seconds
        start = max(ready, last_end)
        last_end = start + seconds
        out.append((seconds, ready, start, last_end))
    return out


def _setting(setting: dict | None) -> dict:
    s = {**DEFAULT, **(setting or {})}
    if s["model"] not in MODELS:
        raise ValueError(f"model must be one of {sorted(MODELS)}, got {s['model']!r}")
    if not 2 <= int(s["world_size"]) <= 1024:
        raise ValueError(f"N must be 2 to 1024 ranks, got {s['world_size']}")
    if s["backward_ms"] <= 0 or s["alpha_us"] < 0 or s["bandwidth_gbps"] <= 0:
        raise ValueError("the backward's time must be > 0, alpha >= 0 and the bandwidth > 0")
    torch_caps(s["bucket_cap_mb"])  # a cap that is not one is refused here
    return s


def compute(setting: dict | None = None) -> BucketView:
    """The buckets and the modelled step for ``setting`` (keys of :data:`DEFAULT`; missing ones take its values)."""
    s = _setting(setting)
    config = MODELS[s["model"]]()
    model = TinyGPT(config, seed=0)
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]  # tied: listed once, as DDP
    params = [p for _, p in named]
    caps = torch_caps(s["bucket_cap_mb"])
    groups = fill_buckets(params, list(reversed(range(len(params)))), caps)
    sizes = [sum(params[i].numel() * params[i].element_size() for i in g) for g in groups]
    n, alpha, beta = int(s["world_size"]), s["alpha_us"] * 1e-6, 1 / (s["bandwidth_gbps"] * 1e9)
    backward_s = s["backward_ms"] * 1e-3
    times = timeline(sizes, backward_s, n, alpha, beta)
    buckets = [Bucket(k, [named[i][0] for i in g], size, *t)
               for k, (g, size, t) in enumerate(zip(groups, sizes, times, strict=True))]
    one = backward_s + ring_cost(sum(sizes), n, alpha, beta).seconds
    per_param = timeline([p.numel() * p.element_size() for p in reversed(params)], backward_s, n, alpha, beta)
    return BucketView(s, config, caps, buckets, backward_s, one, max(backward_s, per_param[-1][3]))


def _time(seconds: float) -> str:
    return f"{seconds * 1e3:,.3f} ms" if seconds >= 1e-3 else f"{seconds * 1e6:,.1f} us"


def format_buckets(view: BucketView) -> str:
    """The buckets (parameters, bytes, the modelled all-reduce), and the step against its two extremes."""
    s, c = view.setting, view.config
    cap = s["bucket_cap_mb"]
    caps = (f"bucket_cap_mb left at default: {DEFAULT_CAP_MB} MiB, the first bucket {FIRST_BUCKET_BYTES:,} bytes"
            if cap in (None, "default") else f"bucket_cap_mb = {cap:g}: every bucket closes at {view.caps[0]:,} "
                                               "bytes, the first included")
    lines = [f"TinyGPT {s['model']} (n_layer {c.n_layer}, n_embd {c.n_embd}): "
             f"{sum(len(b.params) for b in view.buckets)} parameters, {view.total_bytes:,} bytes of fp32 gradients; "
             f"{caps} -> {len(view.buckets)} bucket(s), filled in reverse registration order",
             f"the alpha-beta model, not a measurement: N = {s['world_size']}, alpha = {s['alpha_us']:g} us, "
             f"{s['bandwidth_gbps']:g} GB/s per link (the ring of chapter 2.2); the backward takes "
             f"{s['backward_ms']:g} ms, split over the buckets by their bytes",
             f"{'bucket':<7}{'params':>7}{'bytes':>12}{'all-reduce':>13}{'ready at':>13}{'starts':>13}{'ends':>13}"]
    for b in view.buckets:
        lines.append(f"{b.index:<7}{len(b.params):>7}{b.nbytes:>12,}{_time(b.allreduce_s):>13}{_time(b.ready_s):>13}"
                     f"{_time(b.start_s):>13}{_time(b.end_s):>13}")
        lines += textwrap.wrap(", ".join(b.params), 110, initial_indent="       ", subsequent_indent="       ")
    lines.append(f"step (backward and every all-reduce): {_time(view.step_s)} with these buckets, "
                 f"{_time(view.step_s - view.backward_s)} of it after the backward; one all-reduce after the "
                 f"backward: {_time(view.one_message_s)}; one per parameter: {_time(view.per_parameter_s)}")
    return "\n".join(lines)


def fallback(setting: dict | None = None) -> str:
    """Print (and return) one setting's buckets and the line saying the panel needs a running kernel."""
    return static_view(format_buckets(compute(setting)))


def draw(view: BucketView):
    """The modelled step: the backward's share of each bucket, then each bucket's all-reduce; returns the Figure."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 2.2))
    colours = plt.get_cmap("tab10")
    start = 0.0
    for b in view.buckets:
        colour = colours(b.index % 10)
        ax.barh(1, (b.ready_s - start) * 1e3, left=start * 1e3, color=colour, alpha=0.45, edgecolor="black", lw=0.5)
        ax.barh(0, (b.end_s - b.start_s) * 1e3, left=b.start_s * 1e3, color=colour, edgecolor="black", lw=0.5)
        if len(view.buckets) <= 12:
            ax.text((b.start_s + b.end_s) / 2 * 1e3, 0, str(b.index), ha="center", va="center", fontsize=8)
        start = b.ready_s
    ax.axvline(view.backward_s * 1e3, color="grey", ls="--", lw=0.8)
    ax.set_yticks([0, 1], ["all-reduce", "backward"])
    ax.set_xlabel("ms (the alpha-beta model, not a measurement)")
    ax.set_title(f"{len(view.buckets)} bucket(s), N = {view.setting['world_size']}: step {_time(view.step_s)}, "
                 f"one message after the backward {_time(view.one_message_s)}", fontsize=10)
    fig.tight_layout()
    return fig


def panel():
    """Controls for the cap, N, the model and the backward's time; the buckets as text, and the step drawn."""
    import ipywidgets as widgets
    import matplotlib.pyplot as plt

    controls = {
        "bucket_cap_mb": widgets.SelectionSlider(
            options=[(f"{c:g} MiB" if c != "default" else "default (25, first 1)", c) for c in CAPS_MB],
            value=DEFAULT["bucket_cap_mb"], description="bucket cap"),
        "world_size": widgets.IntSlider(value=DEFAULT["world_size"], min=2, max=64, description="N"),
        "model": widgets.Dropdown(options=list(MODELS), value=DEFAULT["model"], description="model"),
        # stops, not a log slider: the page rounds a log slider's value (0.5 became 0.501187)
        "backward_ms": widgets.SelectionSlider(options=BACKWARD_MS, value=DEFAULT["backward_ms"],
                                               description="backward ms"),
    }

    def redraw(setting: dict) -> None:
        view = compute(setting)
        print(format_buckets(view))
        fig = draw(view)
        plt.show()
        plt.close(fig)

    return live_panel(controls, redraw, "Chapter 1.2: DDP's buckets, and their all-reduces overlapping the backward")


def show(setting: dict | None = None) -> None:
    """A notebook cell's call: the panel in a running kernel; the fallback text on a page without one."""
    show_panel(panel, with_kernel_line(format_buckets(compute(setting))))
