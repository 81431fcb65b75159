"""Chapter 2.2 (Gradient communication): the ring step by step, and what an all-reduce costs in time.

The learner picks a message size S, the number of ranks N, a latency alpha (seconds per message) and a
bandwidth (bytes per second per link, 1/beta); the explorer prices three all-reduces in the latency-bandwidth
model the chapter uses, t = alpha + beta x bytes per message (Thakur, Rabenseifner and Gropp 2005):

    ring               2(N-1) rounds; in each, every rank sends one chunk at once: the round costs
                       alpha + beta x (its largest chunk).  Rounds and chunks are the library's own
                       schedule (``chunk_bounds``, ``reduce_scatter_chunks``, ``all_gather_chunks``), so
                       for S divisible by N it is 2(N-1) alpha + 2(N-1)/N S beta.
    parameter server   the shape of ``naive_all_reduce``: the root takes the N-1 messages of S bytes one
                       after another through its link, then sends the sum back the same way:
                       2(N-1) (alpha + beta S).  Its root sends (N-1) S bytes.
    tree               a binomial-tree reduce, then a binomial-tree broadcast: 2 ceil(log2 N) rounds of one
                       whole message each, 2 ceil(log2 N) (alpha + beta S).

The ring is bandwidth-optimal (its bytes per rank stay under 2 S whatever N) but its latency grows with N; the
tree's latency grows as log N but every round carries all S bytes.  So small messages on many ranks favour the
tree, large ones the ring: the crossing moves as the learner turns alpha and the bandwidth.

Beside the model the panel draws the ring itself at step k of 2(N-1) (the slider notebook 02 had: the states of
``minifsdp.comm.ring_sim.simulate_ring_all_reduce``, drawn by ``minifsdp.pictures.plots.draw_ring_step``), and, at
N = 2 and 4, the all-reduce times measured on this machine by ``python -m minifsdp bench collectives``
(``chapters/results/bench_collectives.json``, gloo's all-reduce: a real machine's points, not the model's).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from minifsdp.comm.ring import all_gather_chunks, chunk_bounds, reduce_scatter_chunks
from minifsdp.comm.ring_sim import simulate_ring_all_reduce
from minifsdp.explorers.panel import live_panel, static_view, with_kernel_line
from minifsdp.explorers.panel import show as show_panel
from minifsdp.pictures.plots import draw_ring_step, ring_states

__all__ = ["DEFAULT", "ALGORITHMS", "Cost", "RingTimes", "ring_cost", "parameter_server_cost", "tree_cost",
           "measured_points", "compute", "format_times", "fallback", "panel", "show"]

DEFAULT = {"message_bytes": 2**20, "world_size": 4, "alpha_us": 10.0, "bandwidth_gbps": 10.0, "step": 0}
ALGORITHMS = ("ring", "parameter server", "tree")
ELEMENT_BYTES = 4  # the ring chunks fp32 numbers
BENCH_RUN = Path(__file__).resolve().parents[2] / "chapters" / "results" / "bench_collectives.json"
MAX_DRAWN = 8  # the ring's picture is drawn up to this many ranks


@dataclass(frozen=True)
class Cost:
    """One algorithm's all-reduce: its rounds, the bytes its busiest rank sends, its time in the model."""
    algorithm: str
    rounds: int
    busiest_bytes: int
    seconds: float


def ring_cost(message_bytes: int, n: int, alpha: float, beta: float) -> Cost:
    """The ring, priced round by round from the library's schedule (module docstring)."""
    bounds = chunk_bounds(message_bytes // ELEMENT_BYTES, n)
    size = [(b - a) * ELEMENT_BYTES for a, b in bounds]
    seconds, sent = 0.0, [0] * n
    for chunks_at in (reduce_scatter_chunks, all_gather_chunks):
        for step in range(n - 1):
            this_round = [size[chunks_at(r, n, step)[0]] for r in range(n)]  # every rank sends one chunk
            sent = [s + b for s, b in zip(sent, this_round, strict=True)]
            seconds += alpha + beta * max(this_round)
    return Cost("ring", 2 * (n - 1), max(sent), seconds)


def parameter_server_cost(message_bytes: int, n: int, alpha: float, beta: float) -> Cost:
    """The root receives N-1 messages, then sends N-1, one at a time: 2(N-1)(alpha + beta S)."""
    rounds = 2 * (n - 1)
    return Cost("parameter server", rounds, (n - 1) * message_bytes, rounds * (alpha + beta * message_bytes))


def tree_cost(message_bytes: int, n: int, alpha: float, beta: float) -> Cost:
    """Binomial reduce then broadcast: 2 ceil(log2 N) rounds of S bytes; a rank sends at most ceil(log2 N) S."""
    depth = math.ceil(math.log2(n)) if n > 1 else 0
    return Cost("tree", 2 * depth, depth * message_bytes, 2 * depth * (alpha + beta * message_bytes))


def measured_points(n: int, run: Path = BENCH_RUN) -> list[tuple[int, float]]:
    """(bytes, seconds) of gloo's all-reduce at N ranks in the committed bench run; [] if none (or no file)."""
    if not run.is_file():
        return []
    return [(row["bytes"], row["gloo_s"]) for row in json.loads(run.read_text())["rows"] if row["world_size"] == n]


@dataclass(frozen=True)
class RingTimes:
    """What ``compute`` returns: the setting, the three costs, curves over sizes, the ring's states."""
    setting: dict
    costs: dict[str, Cost]
    sizes: list[int]  # message sizes of the curves, bytes
    curves: dict[str, list[float]]  # algorithm -> seconds at each size
    measured: list[tuple[int, float]]
    states: list[dict]  # the ring's rounds (plots.ring_states), empty above MAX_DRAWN ranks

    @property
    def fastest(self) -> str:
        return min(self.costs.values(), key=lambda c: c.seconds).algorithm


def _setting(setting: dict | None) -> dict:
    s = {**DEFAULT, **(setting or {})}
    if not 2 <= int(s["world_size"]) <= 1024:
        raise ValueError(f"N must be 2 to 1024 ranks, got {s['world_size']}")
    if s["message_bytes"] < ELEMENT_BYTES or s["alpha_us"] < 0 or s["bandwidth_gbps"] <= 0:
        raise ValueError("the message needs at least one fp32 number, alpha >= 0, the bandwidth > 0")
    return s


def compute(setting: dict | None = None) -> RingTimes:
    """The costs for ``setting`` (keys of :data:`DEFAULT`; missing ones take its values)."""
    s = _setting(setting)
    n, size = int(s["world_size"]), int(s["message_bytes"])
    alpha, beta = s["alpha_us"] * 1e-6, 1 / (s["bandwidth_gbps"] * 1e9)
    price = {"ring": ring_cost, "parameter server": parameter_server_cost, "tree": tree_cost}
    costs = {name: fn(size, n, alpha, beta) for name, fn in price.items()}
    sizes = [2**k for k in range(10, 31)]  # 1 KiB .. 1 GiB
    curves = {name: [fn(b, n, alpha, beta).seconds for b in sizes] for name, fn in price.items()}
    states = []
    if n <= MAX_DRAWN:
        trace = simulate_ring_all_reduce([torch.arange(float(n)) + 10 * r for r in range(n)])
        states = ring_states(trace)
    return RingTimes(s, costs, sizes, curves, measured_points(n), states)


def _time(seconds: float) -> str:
    return f"{seconds * 1e3:,.3f} ms" if seconds >= 1e-3 else f"{seconds * 1e6:,.1f} us"


def format_times(view: RingTimes) -> str:
    """The three costs as a table, which is fastest, and how much of the ring's time is latency."""
    s = view.setting
    lines = [f"all-reduce of S = {int(s['message_bytes']):,} bytes on N = {s['world_size']} ranks; alpha = "
             f"{s['alpha_us']:g} us per message, bandwidth {s['bandwidth_gbps']:g} GB/s per link",
             f"{'algorithm':<18}{'rounds':>7}{'bytes sent (busiest rank)':>27}{'time':>14}"]
    for c in view.costs.values():
        lines.append(f"{c.algorithm:<18}{c.rounds:>7}{c.busiest_bytes:>27,}{_time(c.seconds):>14}")
    ring = view.costs["ring"]
    latency = ring.rounds * s["alpha_us"] * 1e-6
    lines.append(f"fastest: {view.fastest}; latency is {latency / ring.seconds:.0%} of the ring's time")
    if view.measured:
        lines.append(f"measured on this machine at N = {s['world_size']} (gloo, committed run): "
                     + ", ".join(f"{b // 1024} KiB {_time(t)}" for b, t in view.measured[::2]))
    return "\n".join(lines)


def fallback(setting: dict | None = None) -> str:
    """Print (and return) one setting's table and the line saying the panel needs a running kernel."""
    return static_view(format_times(compute(setting)))


def draw(view: RingTimes):
    """The model's three curves over message size (the chosen size marked, this machine's points) and the ring
    at the chosen step; returns the Figure."""
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4), gridspec_kw={"width_ratios": [3, 2]})
    for name, seconds in view.curves.items():
        left.loglog(view.sizes, seconds, label=name)
    if view.measured:
        left.loglog(*zip(*view.measured), "k.", label="gloo, measured here")
    left.axvline(view.setting["message_bytes"], color="grey", ls="--", lw=0.8)
    left.set_xlabel("message size S (bytes)")
    left.set_ylabel("all-reduce time (s)")
    left.set_title(f"N = {view.setting['world_size']}: the alpha-beta model", fontsize=10)
    left.legend(fontsize=8)
    if view.states:
        draw_ring_step(view.states[min(int(view.setting["step"]), len(view.states) - 1)], right)
    else:
        right.axis("off")
        right.text(0.5, 0.5, f"the ring is drawn up to N = {MAX_DRAWN}", ha="center")
    fig.tight_layout()
    return fig


def panel():
    """Controls for S, N, alpha, the bandwidth and the ring's step; the table, the curves, the ring."""
    import ipywidgets as widgets
    import matplotlib.pyplot as plt

    controls = {
        "message_bytes": widgets.SelectionSlider(options=[(f"{b // 1024:,} KiB", b) for b in
                                                          [2**k for k in range(10, 31)]],
                                                 value=DEFAULT["message_bytes"], description="S"),
        "world_size": widgets.IntSlider(value=DEFAULT["world_size"], min=2, max=64, description="N"),
        "alpha_us": widgets.FloatLogSlider(value=DEFAULT["alpha_us"], base=10, min=0, max=4, description="alpha us"),
        "bandwidth_gbps": widgets.FloatLogSlider(value=DEFAULT["bandwidth_gbps"], base=10, min=-1, max=3,
                                                 description="GB/s"),
        "step": widgets.IntSlider(value=0, min=0, max=2 * (DEFAULT["world_size"] - 1), description="ring step"),
    }

    def steps_follow_n(change) -> None:  # registered before the redraw: the step slider ends at 2(N-1)
        controls["step"].max = 2 * (min(change["new"], MAX_DRAWN) - 1)

    controls["world_size"].observe(steps_follow_n, names="value")

    def redraw(setting: dict) -> None:
        view = compute(setting)
        print(format_times(view))
        fig = draw(view)
        plt.show()
        plt.close(fig)

    return live_panel(controls, redraw, "Chapter 2.2: ring, parameter server and tree in the alpha-beta model")


def show(setting: dict | None = None) -> None:
    """A notebook cell's call: the panel in a running kernel; the fallback text on a page without one."""
    show_panel(panel, with_kernel_line(format_times(compute(setting))))
