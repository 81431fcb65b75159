"""Chapter 2.1 (Principle and sharding strategies): each rank's slice of each unit's flat parameter.

The learner picks a tiny GPT's size, the number of ranks N (1-8) and a sharding strategy; the explorer wraps the
model as the book does (one unit per transformer block, the root unit holding the rest) and lays out every unit
with :func:`minifsdp.fsdp.core.flat_param.build_layout`, the layout FSDP itself builds.  It shows, per unit, the
numbers, the padding that makes them split into equal shards, each rank's slice, and where each original parameter
lands (``FlatParamLayout.picture``); per rank, what it holds at rest and between a forward and its backward
(the strategy's ``ShardingPlan``, :mod:`minifsdp.fsdp.core.strategy`).

How a strategy changes the picture::

    FULL_SHARD, SHARD_GRAD_OP   one shard group of N ranks: rank r keeps the r-th 1/N of every unit
    NO_SHARD                    nothing is split: every rank keeps every unit whole (build_layout at N = 1)
    HYBRID_SHARD                shard groups of ``ranks_per_node`` ranks, replicated across nodes: rank r keeps
                                shard r % ranks_per_node, the same numbers as every rank with the same remainder

FULL_SHARD and SHARD_GRAD_OP hold the same slices at rest; they part between forward and backward, where
SHARD_GRAD_OP keeps each unit whole (it frees after the backward only).
"""

from __future__ import annotations

from dataclasses import dataclass

from minifsdp.explorers.panel import live_panel, static_view, with_kernel_line
from minifsdp.explorers.panel import show as show_panel
from minifsdp.fsdp.core.flat_param import FlatParamLayout, build_layout
from minifsdp.fsdp.core.strategy import ShardingPlan, ShardingStrategy
from minifsdp.models import GPTConfig, TinyGPT
from minifsdp.pictures.fsdp_plots import plot_flat_layout

__all__ = ["MODELS", "STRATEGIES", "DEFAULT", "UnitLayout", "ShardView", "compute", "format_view", "fallback",
           "panel", "show"]

MODELS = {"tiny": GPTConfig.tiny, "mini": GPTConfig.mini, "small": GPTConfig.small}
STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD")
DEFAULT = {"model": "tiny", "world_size": 3, "strategy": "FULL_SHARD", "ranks_per_node": 2}


@dataclass(frozen=True)
class UnitLayout:
    """One FSDP unit: its name in the model and its flat layout over the shard group."""
    name: str  # "blocks.0", ..., "root"
    layout: FlatParamLayout

    @property
    def padding(self) -> int:
        return self.layout.padded_numel - self.layout.numel


@dataclass(frozen=True)
class ShardView:
    """What ``compute`` returns: the units' layouts and what each of the N ranks holds."""
    setting: dict
    config: GPTConfig
    plan: ShardingPlan
    shard_size: int  # ranks that split one unit (1 under NO_SHARD)
    units: list[UnitLayout]

    @property
    def world_size(self) -> int:
        return self.setting["world_size"]

    def shard_of(self, rank: int) -> int:
        """Which shard of every unit ``rank`` keeps (its place in its shard group)."""
        return rank % self.shard_size

    def held_at_rest(self, rank: int) -> int:
        """Numbers ``rank`` keeps of all units between steps (padding included): one shard of each."""
        return sum(u.layout.shard_numel for u in self.units)

    def held_between_forward_and_backward(self, rank: int) -> int:
        """Numbers ``rank`` holds of the non-root units after their forward: a shard, or the whole unit if the
        strategy does not free after the forward (SHARD_GRAD_OP, NO_SHARD)."""
        blocks = [u.layout for u in self.units if u.name != "root"]
        return sum(lay.shard_numel if self.plan.frees_after_forward else lay.padded_numel for lay in blocks)


def _setting(setting: dict | None) -> dict:
    merged = {**DEFAULT, **(setting or {})}
    if merged["model"] not in MODELS:
        raise ValueError(f"model must be one of {sorted(MODELS)}, got {merged['model']!r}")
    if merged["strategy"] not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {merged['strategy']!r}")
    if not 1 <= int(merged["world_size"]) <= 8:
        raise ValueError(f"N (world_size) must be 1 to 8, got {merged['world_size']}")
    if merged["strategy"] == "HYBRID_SHARD" and merged["world_size"] % merged["ranks_per_node"]:
        raise ValueError(f"HYBRID_SHARD needs N divisible by ranks_per_node: N = {merged['world_size']}, "
                         f"ranks_per_node = {merged['ranks_per_node']}")
    return merged


def compute(setting: dict | None = None) -> ShardView:
    """The units' layouts for ``setting`` (keys of :data:`DEFAULT`; missing ones take its values)."""
    s = _setting(setting)
    config = MODELS[s["model"]]()
    model = TinyGPT(config, seed=0)
    plan = ShardingPlan.of(ShardingStrategy[s["strategy"]], s["world_size"])
    shard_size = (1 if not plan.shards_params else s["ranks_per_node"] if plan.two_groups else s["world_size"])
    units = [UnitLayout(f"blocks.{i}", build_layout(block, list(block.parameters()), shard_size))
             for i, block in enumerate(model.blocks)]
    root = [p for name, p in model.named_parameters() if not name.startswith("blocks.")]
    units.append(UnitLayout("root", build_layout(model, root, shard_size)))
    return ShardView(s, config, plan, shard_size, units)


def format_view(view: ShardView) -> str:
    """The view as text: the strategy's groups, a table of units, what each rank holds, two units' pictures."""
    s, c, n = view.setting, view.config, view.world_size
    groups = {"FULL_SHARD": f"one shard group of {n} ranks", "SHARD_GRAD_OP": f"one shard group of {n} ranks",
              "NO_SHARD": "no sharding: every rank holds every unit whole",
              "HYBRID_SHARD": f"{n // view.shard_size} nodes of {view.shard_size} ranks: sharded inside a node, "
                              "replicated across nodes"}[s["strategy"]]
    lines = [f"TinyGPT {s['model']} (n_layer {c.n_layer}, n_embd {c.n_embd}), N = {n}, {s['strategy']}: {groups}",
             f"{'unit':<10}{'numbers':>9}{'padded':>9}{'per shard':>11}{'padding':>9}"]
    for u in view.units:
        lay = u.layout
        lines.append(f"{u.name:<10}{lay.numel:>9,}{lay.padded_numel:>9,}{lay.shard_numel:>11,}{u.padding:>9,}")
    total = sum(u.layout.numel for u in view.units)
    lines.append(f"each rank holds {view.held_at_rest(0):,} of the model's {total:,} numbers at rest "
                 f"(padding included); between forward and backward its blocks take "
                 f"{view.held_between_forward_and_backward(0):,} "
                 f"({'freed after forward' if view.plan.frees_after_forward else 'kept whole until backward'})")
    if view.shard_size < n and view.shard_size > 1:
        lines.append("; ".join(f"ranks {[r for r in range(n) if view.shard_of(r) == k]} hold shard {k}"
                               for k in range(view.shard_size)))
    for u in (view.units[0], view.units[-1]):
        more = " (every block is laid out the same)" if u.name != "root" else ""
        tied = f"; tied, stored once: {[t.fqn for t in u.layout.shared]}" if u.layout.shared else ""
        lines += [f"unit {u.name}{more}{tied}: shard k of its flat parameter", u.layout.picture(rank_width=6)
                  .replace("rank ", "shard ")]
    return "\n".join(lines)


def fallback(setting: dict | None = None) -> str:
    """Print (and return) one setting's text and the line saying the panel needs a running kernel."""
    return static_view(format_view(compute(setting)))


def panel():
    """Controls for the model, N, the strategy and HYBRID's node size; the text and the first block's picture."""
    import ipywidgets as widgets
    import matplotlib.pyplot as plt

    controls = {
        "model": widgets.Dropdown(options=list(MODELS), value=DEFAULT["model"], description="model"),
        "world_size": widgets.IntSlider(value=DEFAULT["world_size"], min=1, max=8, description="N"),
        "strategy": widgets.Dropdown(options=STRATEGIES, value=DEFAULT["strategy"], description="strategy"),
        "ranks_per_node": widgets.IntSlider(value=DEFAULT["ranks_per_node"], min=1, max=8,
                                            description="ranks/node"),
    }

    def draw(setting: dict) -> None:
        view = compute(setting)
        print(format_view(view))
        fig = plot_flat_layout(view.units[0].layout, title=f"{view.units[0].name}: its flat parameter, "
                                                            f"{view.shard_size} shard(s)")
        plt.show()
        plt.close(fig)

    return live_panel(controls, draw, "Chapter 2.1: where each parameter lands (build_layout)")


def show(setting: dict | None = None) -> None:
    """A notebook cell's call: the panel in a running kernel; the fallback text on a page without one."""
    show_panel(panel, with_kernel_line(format_view(compute(setting))))
