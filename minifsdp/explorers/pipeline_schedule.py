"""Chapter 4.4 (Pipeline parallelism: GPipe and 1F1B): which stage runs which forward and backward at each tick.

The learner picks the number of stages S, of micro-batches M and a schedule; the explorer runs the library's own
schedules (``minifsdp.parallel.pipeline_schedules``): each stage's order of actions is ``action_order`` (what
``ScheduleGPipe`` and ``Schedule1F1B`` run on a rank), and ``simulate_timeline`` places every action in the
first tick its input is there, when every F and B takes one tick::

    GPipe, S = 3, M = 4                                1F1B, the same sizes
    stage 0: F0 F1 F2 F3 .  .  .  .  B0 B1 B2 B3       stage 0: F0 F1 F2 .  .  B0 F3 B1 .  B2 .  B3
    stage 1: .  F0 F1 F2 F3 .  .  B0 B1 B2 B3 .        stage 1: .  F0 F1 .  B0 F2 B1 F3 B2 .  B3 .
    stage 2: .  .  F0 F1 F2 F3 B0 B1 B2 B3 .  .        stage 2: .  .  F0 B0 F1 B1 F2 B2 F3 B3 .  .

From the ticks it counts the bubble, the idle share of the stages' time (idle ticks / (S x ticks)), and sets it
beside the closed form (S-1)/(M+S-1) (``bubble_fraction``): the two schedules have the same bubble, only more
micro-batches shrink it.  What 1F1B saves is memory: the most micro-batches a stage holds activations of at once
(forwards run minus backwards run) is M for GPipe, S - s for 1F1B's stage s.  The picture is
``minifsdp.pictures.parallel_plots.plot_pipeline_timeline`` of the same ticks.
"""

from __future__ import annotations

from dataclasses import dataclass

from minifsdp.explorers.panel import live_panel, static_view, with_kernel_line
from minifsdp.explorers.panel import show as show_panel
from minifsdp.parallel.pipeline_schedules import action_order, bubble_fraction, format_timeline, simulate_timeline
from minifsdp.pictures.parallel_plots import plot_pipeline_timeline

__all__ = ["SCHEDULES", "DEFAULT", "PipelineView", "in_flight", "compute", "format_schedule", "fallback", "panel",
           "show"]

SCHEDULES = {"GPipe": "gpipe", "1F1B": "1f1b"}  # the panel's names -> the library's
DEFAULT = {"stages": 4, "microbatches": 8, "schedule": "1F1B"}


def in_flight(row: list[str | None]) -> int:
    """The most micro-batches one stage holds activations of at once: forwards run minus backwards run."""
    held = most = 0
    for action in row:
        if action:
            held += 1 if action[0] == "F" else -1
            most = max(most, held)
    return most


@dataclass(frozen=True)
class PipelineView:
    """What ``compute`` returns: the setting, every stage's ticks, the bubble counted and by formula."""
    setting: dict
    slots: list[list[str | None]]  # slots[s][t]: stage s's action at tick t ("F3", "B0"), None when idle
    formula: float  # (S-1)/(M+S-1)

    @property
    def ticks(self) -> int:
        return len(self.slots[0])

    @property
    def bubble(self) -> float:
        """Idle ticks over all the stages' ticks, counted in the timeline."""
        idle = sum(a is None for row in self.slots for a in row)
        return idle / (len(self.slots) * self.ticks)

    @property
    def held(self) -> list[int]:
        return [in_flight(row) for row in self.slots]


def _setting(setting: dict | None) -> dict:
    s = {**DEFAULT, **(setting or {})}
    if s["schedule"] not in SCHEDULES:
        raise ValueError(f"schedule must be one of {sorted(SCHEDULES)}, got {s['schedule']!r}")
    if not 1 <= int(s["stages"]) <= 16 or not 1 <= int(s["microbatches"]) <= 64:
        raise ValueError(f"stages must be 1 to 16 and micro-batches 1 to 64, got {s['stages']} and "
                         f"{s['microbatches']}")
    return s


def compute(setting: dict | None = None) -> PipelineView:
    """The timeline for ``setting`` (keys of :data:`DEFAULT`); 1F1B with fewer micro-batches than stages is refused
    (as torch's ``Schedule1F1B``), by the library's own check."""
    s = _setting(setting)
    stages, micro = int(s["stages"]), int(s["microbatches"])
    slots = simulate_timeline(SCHEDULES[s["schedule"]], stages, micro)
    return PipelineView(s, slots, bubble_fraction(stages, micro))


def format_schedule(view: PipelineView) -> str:
    """Each stage's order, the ticks, the bubble counted beside the formula, and the micro-batches held."""
    s = view.setting
    stages, micro = int(s["stages"]), int(s["microbatches"])
    lines = [f"{s['schedule']}, S = {stages} stages, M = {micro} micro-batches; every F and B takes one tick "
             f"(the library's simulate_timeline; '.' is idle)",
             format_timeline(view.slots),
             f"{view.ticks} ticks; bubble (idle ticks / stages x ticks) = {view.bubble:.4f}; "
             f"formula (S-1)/(M+S-1) = {stages - 1}/{micro + stages - 1} = {view.formula:.4f}",
             "micro-batches whose activations a stage holds at once: "
             + ", ".join(f"stage {i} {h}" for i, h in enumerate(view.held))]
    first = " ".join(action_order(SCHEDULES[s["schedule"]], 0, stages, micro))
    lines.append(f"stage 0 runs, in order: {first}")
    return "\n".join(lines)


def fallback(setting: dict | None = None) -> str:
    """Print (and return) one setting's timeline and the line saying the panel needs a running kernel."""
    return static_view(format_schedule(compute(setting)))


def panel():
    """Sliders for S and M, a menu for the schedule; the ticks as text, and the timeline drawn."""
    import ipywidgets as widgets
    import matplotlib.pyplot as plt

    controls = {
        "stages": widgets.IntSlider(value=DEFAULT["stages"], min=1, max=8, description="stages S"),
        "microbatches": widgets.IntSlider(value=DEFAULT["microbatches"], min=1, max=16, description="micro M"),
        "schedule": widgets.Dropdown(options=list(SCHEDULES), value=DEFAULT["schedule"], description="schedule"),
    }

    def draw(setting: dict) -> None:
        view = compute(setting)
        print(format_schedule(view))
        fig, ax = plt.subplots(figsize=(10, 0.6 * len(view.slots) + 1.2))
        plot_pipeline_timeline(view.slots, ax=ax, title=f"{setting['schedule']}", unit="ticks")
        fig.tight_layout()
        plt.show()
        plt.close(fig)

    return live_panel(controls, draw, "Chapter 4.4: the pipeline's ticks and its bubble")


def show(setting: dict | None = None) -> None:
    """A notebook cell's call: the panel in a running kernel; the fallback text on a page without one."""
    show_panel(panel, with_kernel_line(format_schedule(compute(setting))))
