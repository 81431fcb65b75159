"""Chapter 6 (When FSDP goes wrong): one pitfall, run on torch's FSDP and on ours, side by side.

The learner picks a pitfall of the chapter and a world size N and presses **run**: the explorer spawns N ranks
that run the chapter's own reproduction (``minifsdp/cells/pitfall_runs.py``, the code ``tests/test_pitfalls.py``
holds ours to torch with) and prints what each side did, case by case, beside the chapter's one-line why::

    [pitfall: clip v] [N: --o-- 2] [run]
    case                               torch FSDP                       ours
    torch.nn.utils.clip_grad_norm_     rank 0 0.4051, rank 1 0.4432     rank 0 0.4051, rank 1 0.4432
    model.clip_grad_norm_              rank 0 0.5933, rank 1 0.5933     ...
    why: each rank's model.parameters() is its flat shard ...

Running ranks takes seconds, so a setting is run only when **run** is pressed, and each (pitfall, N) result is
kept in this process (:data:`RUNS`): turning back to a setting already run shows it at once.  Nothing is drawn in
advance: every number is a fact the ranks returned (rank 0's, unless a row names the rank).
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass

from minifsdp.cells.pitfall_runs import run_pitfalls
from minifsdp.explorers.panel import live_panel, static_view, with_kernel_line
from minifsdp.explorers.panel import show as show_panel
from minifsdp.launch import spawn

__all__ = ["PITFALLS", "DEFAULT", "RUNS", "run_many", "run", "PitfallView", "rows_of", "compute", "format_pitfall",
           "fallback", "panel", "show"]

PITFALLS = {  # name -> (the chapter's section, the one-line why, the fix), from chapters/06_when_fsdp_goes_wrong.md
    "optimizer": ("Pitfall 1: an optimizer built before sharding, or after a forward",
                  "an optimizer keeps references to tensor objects: fully_shard replaces each parameter by a new one "
                  "(its rows), and after a forward the root keeps its unsharded ones registered; the objects the "
                  "optimizer holds get no gradient",
                  "build the optimizer after sharding and before the first forward; after a forward, model.reshard()"),
    "hybrid": ("Pitfall 2: HYBRID_SHARD with a shard group of one rank",
               "torch's _init_core_state sees a shard group of 1, switches to NO_SHARD, and all-reduces over that "
               "same 1-rank group: the replicate group is never used, the replicas drift apart",
               "on torch FSDP1, ask for NO_SHARD (or FULL_SHARD) over all ranks"),
    "load": ("Pitfall 3: a checkpoint loaded after a forward",
             "the root keeps the full parameters it gathered after its forward, and the next forward uses them "
             "without gathering: a LOCAL load writes the shards, so it is lost; a FULL one breaks the pending backward",
             "load before the first forward or after a backward; run forwards you do not differentiate under no_grad"),
    "clip": ("Pitfall 4: torch.nn.utils.clip_grad_norm_ on flat shards",
             "each rank's model.parameters() is its flat shard, so the plain function returns the norm of this "
             "rank's numbers: a different norm, and a different scale, on each rank",
             "model.clip_grad_norm_(max_norm) on the FSDP1 root: it all-reduces the squares before the root"),
    "frozen": ("Pitfall 5: frozen and trainable parameters in one flat parameter",
               "one flat parameter has one requires_grad: without use_orig_params both refuse; with it, the flat "
               "gradient covers the frozen numbers too and is reduce-scattered whole",
               "wrap the frozen part in its own unit, or use FSDP2 (each parameter keeps its requires_grad)"),
}
WORLD_SIZES = (2, 3)
DEFAULT = {"pitfall": "clip", "world_size": 2}
RUNS: dict[tuple[str, int], list[dict]] = {}  # (pitfall, N) -> each rank's facts, kept for the panel


def run_many(pitfalls: list[str], world_size: int) -> None:
    """Run every pitfall of ``pitfalls`` not in :data:`RUNS` yet at ``world_size`` ranks, in one spawn; keep each."""
    todo = [p for p in dict.fromkeys(pitfalls) if (p, int(world_size)) not in RUNS]
    if todo:
        facts = spawn(run_pitfalls, args=(todo,), world_size=int(world_size), timeout_s=300)
        for p in todo:
            RUNS[p, int(world_size)] = [f[p] for f in facts]


def run(pitfall: str, world_size: int) -> list[dict]:
    """Each rank's facts for ``pitfall`` at ``world_size`` ranks: spawned once, then kept in :data:`RUNS`."""
    run_many([pitfall], world_size)
    return RUNS[pitfall, int(world_size)]


@dataclass(frozen=True)
class PitfallView:
    """What ``compute`` returns: the setting, its section, and rows of (case, what torch did, what ours did)."""
    setting: dict
    section: str
    why: str
    fix: str
    rows: list[tuple[str, str, str]]


def _said(outcome) -> str:
    """An error as its type and first sentence; None (nothing raised) as such."""
    if outcome is None:
        return "no error"
    kind, message = outcome
    said = f"{kind}: {message.split('. ')[0].rstrip('.')}."
    return said if len(said) <= 170 else said[:166].rstrip() + " ..."


def _losses(pair) -> str:
    before, after = pair
    return f"loss {before:.6f} -> {after:.6f}" + (" (nothing trained)" if before == after else "")


def _warned(messages: list[str]) -> str:
    return "warns: " + " | ".join(m.split(". ")[0] for m in messages) if messages else "warns nothing"


def _per_rank(values) -> str:
    return ", ".join(f"rank {r} {float(v):.6f}" for r, v in enumerate(values))


def rows_of(pitfall: str, facts: list[dict]) -> list[tuple[str, str, str]]:
    """(case, torch, ours) rows from the ranks' facts (``minifsdp.cells.pitfall_runs``'s keys)."""
    f = facts[0]
    if pitfall == "optimizer":
        rows = []
        for when, case in (("before", "before fully_shard"), ("after_forward", "after a forward"),
                           ("after_no_grad_forward", "after a no_grad forward"),
                           ("after_reshard", "after a forward, then reshard()"), ("after", "after fully_shard")):
            ours = f[f"ours_fsdp2_{when}"]
            ours = _losses(ours[1]) if ours[0] == "trained" else _said(ours)
            rows.append((f"FSDP2, optimizer built {case}", _losses(f[f"torch_fsdp2_{when}"]), ours))
        return rows
    if pitfall == "hybrid":
        return [("replicas equal after one step", str(f["torch_replicas_equal"]), str(f["ours_replicas_equal"])),
                ("what it says at wrap time", _warned(f["torch_warnings"]), _warned(f["ours_warnings"])),
                ("ours bitwise torch's NO_SHARD over all ranks (the fix)", "-", str(f["ours_bitwise_torch_no_shard"]))]
    if pitfall == "load":
        rows = []
        for kind in ("full", "local"):
            awaiting = f[f"ours_{kind}_awaiting"]
            for when, case in (("awaiting", "after a forward with grad"), ("no_grad", "after a no_grad forward")):
                unchanged, loaded = f[f"torch_{kind}_{when}"]
                theirs = "loaded" if loaded else ("lost: the output is unchanged" if unchanged else "neither")
                if when == "awaiting":
                    ours = _said(awaiting)
                else:
                    unchanged, loaded = f[f"ours_{kind}_{when}"]
                    ours = ("loaded" if loaded else "not loaded") + \
                        (", bitwise torch's output" if f[f"ours_{kind}_no_grad_bitwise_torch"] else "")
                rows.append((f"{kind.upper()} load {case}", theirs, ours))
        return rows
    if pitfall == "clip":
        rows = [(label, _per_rank(r["torch"][i] for r in facts), _per_rank(r["ours"][i] for r in facts))
                for i, label in enumerate(("torch.nn.utils.clip_grad_norm_", "model.clip_grad_norm_"))]
        rows.append(("the plain model on the whole batch, one process", f"{float(f['plain']):.6f}", "(the oracle)"))
        return rows
    if pitfall == "frozen":
        t, o = f["torch_orig"], f["ours_orig"]
        same = len(t[4]) == len(o[4]) and bool(t[3].equal(o[3]))
        return [("one unit, use_orig_params=False", _said(f["torch_flat"]), _said(f["ours_flat"])),
                ("use_orig_params=True: rank 0's flat gradient numbers / the trainable ones", f"{t[0]:,} / {t[2]:,}",
                 f"{o[0]:,} / {o[2]:,}" + (", the flat gradient bitwise torch's" if same else ""))]
    raise ValueError(f"pitfall must be one of {list(PITFALLS)}, got {pitfall!r}")


def _setting(setting: dict | None) -> dict:
    s = {**DEFAULT, **(setting or {})}
    if s["pitfall"] not in PITFALLS:
        raise ValueError(f"pitfall must be one of {list(PITFALLS)}, got {s['pitfall']!r}")
    if int(s["world_size"]) not in WORLD_SIZES:
        raise ValueError(f"N must be one of {WORLD_SIZES}, got {s['world_size']}")
    return s


def compute(setting: dict | None = None) -> PitfallView:
    """The pitfall's rows for ``setting`` (keys of :data:`DEFAULT`): runs its ranks unless :data:`RUNS` has them."""
    s = _setting(setting)
    section, why, fix = PITFALLS[s["pitfall"]]
    return PitfallView(s, section, why, fix, rows_of(s["pitfall"], run(s["pitfall"], s["world_size"])))


def _cells(text: str, width: int) -> list[str]:
    return textwrap.wrap(text, width) or [""]


def format_pitfall(view: PitfallView) -> str:
    """The rows side by side (case | torch FSDP | ours), then the chapter's why and fix."""
    widths = (34, 42, 42)
    lines = [f"{view.section} (chapter 6), N = {view.setting['world_size']}",
             "each side run in the same ranks by minifsdp/cells/pitfall_runs.py; rank 0's numbers unless a row names "
             "the rank",
             "".join(f"{h:<{w + 2}}" for h, w in zip(("case", "torch FSDP", "ours"), widths, strict=True)).rstrip()]
    for row in view.rows:
        cols = [_cells(text, w) for text, w in zip(row, widths, strict=True)]
        for k in range(max(map(len, cols))):
            lines.append("".join(f"{(c[k] if k < len(c) else ''):<{w + 2}}"
                                 for c, w in zip(cols, widths, strict=True)).rstrip())
    lines += textwrap.wrap("why: " + view.why, 120, subsequent_indent="     ")
    lines += textwrap.wrap("fix: " + view.fix, 120, subsequent_indent="     ")
    return "\n".join(lines)


def fallback(setting: dict | None = None) -> str:
    """Print (and return) one setting's rows, computed, and the line saying the panel needs a running kernel."""
    return static_view(format_pitfall(compute(setting)))


def panel():
    """A menu of pitfalls, a slider for N and a run button; a setting already run is shown at once."""
    import ipywidgets as widgets

    controls = {"pitfall": widgets.Dropdown(options=list(PITFALLS), value=DEFAULT["pitfall"], description="pitfall"),
                "world_size": widgets.IntSlider(value=DEFAULT["world_size"], min=WORLD_SIZES[0],
                                                max=WORLD_SIZES[-1], description="N")}
    button = widgets.Button(description="run", tooltip="spawn N ranks and run the pitfall on torch and on ours")

    def draw(setting: dict) -> None:
        s = _setting(setting)
        if (s["pitfall"], int(s["world_size"])) in RUNS:
            print(format_pitfall(compute(s)))
        else:
            print(f"{PITFALLS[s['pitfall']][0]}, N = {s['world_size']}: not run yet; press run "
                  f"({s['world_size']} ranks, torch's FSDP and ours, a few seconds)")

    box = live_panel(controls, draw, "Chapter 6: a pitfall, on torch's FSDP and on ours")
    title, row, out = box.children

    def pressed(_button) -> None:
        setting = {key: control.value for key, control in controls.items()}
        with out:
            out.clear_output(wait=True)
            print(f"running {setting['pitfall']} on {setting['world_size']} ranks ...")
            view = compute(setting)
            out.clear_output(wait=True)
            print(format_pitfall(view))

    button.on_click(pressed)
    box.children = (title, widgets.HBox([*row.children, button]), out)
    return box


def show(setting: dict | None = None) -> None:
    """A notebook cell's call: the panel in a running kernel; the fallback text on a page without one."""
    show_panel(panel, with_kernel_line(format_pitfall(compute(setting))))
