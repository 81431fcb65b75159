"""Pictures for the notebooks: ring steps, DDP bucket timelines, loss curves.

Every function draws with matplotlib and returns the ``Figure``; nothing here
needs a display (the Agg backend works), so the same calls run in JupyterLab,
under nbconvert and in tests.

Ring steps.  A ring all-reduce over N ranks cuts each rank's tensor into N
chunks and moves one chunk per rank per step, always to the next rank.  We
draw the state after each step as a grid (rows: ranks, columns: chunks); a
cell lists whose contributions it holds, and its shade grows as it fills up:

    after reduce-scatter step 1 of 2 (N = 3):
               chunk 0   chunk 1   chunk 2
    rank 0     0         0         0+2
    rank 1     0+1       1         1
    rank 2     2         1+2       2

Pass a ``minifsdp.comm.ring_sim.RingTrace`` or a list of step records; each
record needs ``phase`` ("reduce-scatter"/"reduce_scatter" or "all-gather"/"all_gather"),
``step``, ``sender``, ``receiver`` and ``chunk`` (a dict or an object with
those attributes).  The grid is *recomputed from the records*: reduce-scatter
adds the sender's chunk into the receiver's, all-gather overwrites it.  All
sends of one step happen at once, so each reads the state before the step.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping, Sequence

__all__ = ["ring_states", "plot_ring_steps", "draw_ring_step", "ring_widget", "plot_bucket_timeline", "plot_losses",
           "save_figure"]

PHASES = ("reduce_scatter", "all_gather")
SAVE_FIGURES_ENV = "MINIFSDP_SAVE_FIGURES"  # "1": save_figure writes the chapters' figures (else a temporary folder)


def _field(record: Any, name: str) -> Any:
    if isinstance(record, Mapping):
        return record[name]
    return getattr(record, name)


def _steps_by_time(steps: Iterable[Any]) -> list[tuple[tuple[str, int], list[Any]]]:
    """Group the records into (phase, step) rounds, reduce-scatter first."""
    if hasattr(steps, "steps"):  # a minifsdp.comm.ring_sim.RingTrace
        steps = steps.steps
    rounds: dict[tuple[str, int], list[Any]] = {}
    for rec in steps:
        phase = str(_field(rec, "phase")).replace("-", "_")  # ring_sim writes "reduce-scatter"
        if phase not in PHASES:
            raise ValueError(f"step record has phase {phase!r}; expected one of {PHASES}")
        rounds.setdefault((phase, int(_field(rec, "step"))), []).append(rec)
    return sorted(rounds.items(), key=lambda kv: (PHASES.index(kv[0][0]), kv[0][1]))


def ring_states(steps: Iterable[Any], world_size: int | None = None) -> list[dict]:
    """Replay the records; returns one state per round (plus the start).

    Each state is ``{"title", "holds", "moves"}`` where ``holds[r][c]`` is the
    set of ranks whose contribution rank r holds for chunk c, and ``moves`` the
    (sender, receiver, chunk) triples of that round.
    """
    if world_size is None and hasattr(steps, "world_size"):
        world_size = steps.world_size
    rounds = _steps_by_time(steps)
    if world_size is None:
        ranks = {int(_field(r, k)) for _, recs in rounds for r in recs for k in ("sender", "receiver")}
        world_size = max(ranks) + 1 if ranks else 1
    n = world_size
    holds = [[{r} for _ in range(n)] for r in range(n)]
    states = [{"title": "start: every rank holds only its own data", "holds": [[set(s) for s in row] for row in holds],
               "moves": []}]
    for t, ((phase, _step), recs) in enumerate(rounds, start=1):
        before = [[set(s) for s in row] for row in holds]
        moves = []
        for rec in recs:
            s, r, c = (int(_field(rec, k)) for k in ("sender", "receiver", "chunk"))
            if not (0 <= s < n and 0 <= r < n and 0 <= c < n):
                raise ValueError(f"step record {rec!r} names a rank or chunk outside 0..{n - 1}")
            holds[r][c] = (holds[r][c] | before[s][c]) if phase == "reduce_scatter" else set(before[s][c])
            moves.append((s, r, c))
        label = "reduce-scatter" if phase == "reduce_scatter" else "all-gather"
        snapshot = [[set(x) for x in row] for row in holds]
        states.append({"title": f"step {t} of {len(rounds)}: {label}", "holds": snapshot, "moves": moves})
    return states


def draw_ring_step(state: dict, ax) -> None:
    """Draw one state from :func:`ring_states` on a matplotlib ``ax``."""
    import matplotlib.patches as mpatches

    holds = state["holds"]
    n = len(holds)
    ax.clear()
    for r in range(n):
        for c in range(n):
            have = holds[r][c]
            shade = len(have) / n
            ax.add_patch(mpatches.Rectangle((c, r), 1, 1, facecolor=(1 - 0.6 * shade, 1 - 0.3 * shade, 1.0),
                                            edgecolor="black", lw=0.8))
            text = "+".join(str(x) for x in sorted(have)) if len(have) < n else "all"
            ax.text(c + 0.5, r + 0.5, text, ha="center", va="center", fontsize=8)
    for s, r, c in state["moves"]:  # an arrow from the sender's cell to the receiver's
        ax.annotate("", xy=(c + 0.8, r + 0.5), xytext=(c + 0.8, s + 0.5),
                    arrowprops=dict(arrowstyle="->", color="tab:red", lw=1.2, connectionstyle="arc3,rad=0.3"))
    ax.set_xlim(0, n)
    ax.set_ylim(n, 0)
    ax.set_xticks([c + 0.5 for c in range(n)], [f"chunk {c}" for c in range(n)], fontsize=7)
    ax.set_yticks([r + 0.5 for r in range(n)], [f"rank {r}" for r in range(n)], fontsize=7)
    ax.set_title(state["title"], fontsize=9)
    ax.set_aspect("equal")


def plot_ring_steps(steps: Iterable[Any], world_size: int | None = None, cols: int = 4):
    """All rounds of a ring collective side by side; returns the Figure."""
    import matplotlib.pyplot as plt

    states = ring_states(steps, world_size)
    rows = -(-len(states) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3 * cols, 3 * rows), squeeze=False)
    for ax in axes.flat[len(states):]:
        ax.axis("off")
    for state, ax in zip(states, axes.flat):
        draw_ring_step(state, ax)
    fig.suptitle("ring all-reduce: red arrows are this step's sends (sender row -> receiver row)", fontsize=10)
    fig.tight_layout()
    return fig


def format_ring_state(state: dict) -> str:
    """A text version of one state (the fallback when ipywidgets is missing)."""
    n = len(state["holds"])
    lines = [state["title"], "         " + "".join(f"chunk {c:<6}" for c in range(n))]
    for r in range(n):
        cells = ["+".join(str(x) for x in sorted(h)) for h in state["holds"][r]]
        lines.append(f"rank {r:<4}" + "".join(f"{c:<12}" for c in cells))
    lines += [f"  rank {s} -> rank {r}: chunk {c}" for s, r, c in state["moves"]]
    return "\n".join(lines)


def ring_widget(steps: Iterable[Any], world_size: int | None = None):
    """A slider that shows one round at a time; prints every round if ipywidgets is missing."""
    states = ring_states(steps, world_size)
    try:
        import ipywidgets as widgets
    except ImportError:
        print("(ipywidgets is not installed: printing every step instead of a slider)")
        for state in states:
            print(format_ring_state(state), end="\n\n")
        return None
    import matplotlib.pyplot as plt

    out = widgets.Output()
    slider = widgets.IntSlider(value=0, min=0, max=len(states) - 1, description="step")

    def show(change=None):
        with out:
            out.clear_output(wait=True)
            fig, ax = plt.subplots(figsize=(4, 4))
            draw_ring_step(states[slider.value], ax)
            plt.show()
            plt.close(fig)

    slider.observe(show, names="value")
    show()
    return widgets.VBox([slider, out])


def plot_bucket_timeline(events: Sequence[Mapping[str, Any]], backward_span: tuple[float, float], ax=None):
    """Gantt chart: the backward pass on top, one bar per bucket all-reduce below.

    Args:
        events: ``{"bucket", "issued", "finished"}`` dicts (``DistributedDataParallel(trace=True).bucket_events``),
            times in seconds from any common clock (e.g. ``time.perf_counter``).
        backward_span: (start, end) of backward on the same clock (``ddp.backward_window``).

    Times are drawn in milliseconds from the start of backward.  A bar that
    starts before the backward bar ends is communication hidden behind compute.
    """
    import matplotlib.pyplot as plt

    t0, t1 = backward_span
    if not t1 >= t0:
        raise ValueError(f"backward_span must be (start, end) with end >= start, got {backward_span!r}")
    if ax is None:
        fig, ax = plt.subplots(figsize=(7, 1.2 + 0.35 * len(events)))
    else:
        fig = ax.figure
    ms = lambda t: 1e3 * (t - t0)
    ax.barh(0, ms(t1), left=0, color="tab:gray", height=0.6)
    labels = ["backward"]
    for i, ev in enumerate(events, start=1):
        start, end = ev["issued"], ev["finished"] if ev["finished"] is not None else ev["issued"]
        hidden = start < t1
        ax.barh(i, max(ms(end) - ms(start), 1e-3), left=ms(start), height=0.6,
                color="tab:green" if hidden else "tab:orange")
        labels.append(f"bucket {ev['bucket']}")
    ax.axvline(ms(t1), color="black", ls="--", lw=0.8)
    ax.set_yticks(range(len(labels)), labels)
    ax.invert_yaxis()
    ax.set_xlabel("ms since the first gradient hook (green: all-reduce started while backward was running)")
    ax.set_title("DDP: bucket all-reduces against the backward pass", fontsize=10)
    fig.tight_layout()
    return fig


def plot_losses(curves: Mapping[str, Sequence[float]], ax=None, title: str = "training loss"):
    """One line per named loss curve (e.g. {"ours": [...], "torch": [...]})."""
    import matplotlib.pyplot as plt

    if not curves:
        raise ValueError("plot_losses needs at least one curve, e.g. {'ours': losses}")
    if ax is None:
        fig, ax = plt.subplots(figsize=(6, 3.5))
    else:
        fig = ax.figure
    styles = ["-", "--", ":", "-."]
    for i, (name, values) in enumerate(curves.items()):
        ax.plot(range(len(values)), list(values), styles[i % len(styles)], label=name, lw=1.5)
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(title, fontsize=10)
    ax.legend()
    fig.tight_layout()
    return fig


def save_figure(fig, name: str, root=None):
    """Save ``fig`` as ``<name>.png``; returns the path.  Into ``chapters/figures/`` only when asked.

    The chapters show the key plots of their notebooks (``![...](figures/<name>.png)``), so that they read on
    their own.  A notebook that draws one calls this each time it runs, and the tests run every notebook: so
    the committed figure is rewritten only with ``MINIFSDP_SAVE_FIGURES=1`` in the environment (regenerating
    the figures is a command of its own: ``chapters/README.md``); otherwise the picture goes to a temporary
    folder and the checkout stays as it was.  ``root`` is the repository (default: the first of the working
    directory and its parents that holds ``chapters/``).  No metadata (software version) is written, so a
    figure drawn from the same numbers is the same file.
    """
    import os
    import tempfile
    from pathlib import Path

    if os.environ.get(SAVE_FIGURES_ENV) != "1":
        folder = Path(tempfile.gettempdir()) / "minifsdp-figures"
    else:
        if root is None:
            here = Path.cwd().resolve()
            root = next((p for p in (here, *here.parents) if (p / "chapters").is_dir()), None)
            if root is None:
                raise FileNotFoundError(f"no chapters/ folder in {here} or above it; pass root=the repository")
        folder = Path(root) / "chapters" / "figures"
    path = folder / f"{name}.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight", metadata={"Software": None})
    return path
