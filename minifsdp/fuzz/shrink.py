"""Make a difference small: the fewest steps, blocks and options that still show it.

    program with a difference in field F
      round: every one-change simplification (a step dropped, a block dropped, an option back to torch's
             default, a container made a tensor, fewer ranks, ...), run in one spawn per world size
      keep the first (most reduced first) that still shows an unexplained difference in F; repeat
      until no simplification keeps it

This is delta debugging one change at a time (Zeller's ddmin with single deletions): each round costs a
spawn or two, and a drawn program shrinks in a handful of rounds.  The result prints as a standalone script
(``script.py``) a reader can run and read.
"""

from __future__ import annotations

from minifsdp.fuzz.campaign import Outcome, run_batch
from minifsdp.fuzz.program import Program, block_paths

__all__ = ["shrink", "simplifications"]

FSDP1_DEFAULTS = {"sharding_strategy": "FULL_SHARD", "use_orig_params": False, "mixed_precision": None,
                  "backward_prefetch": "BACKWARD_PRE", "forward_prefetch": False, "limit_all_gathers": True,
                  "cpu_offload": False, "scaler": False, "ac": None}
FSDP2_DEFAULTS = {"reshard_after_forward": True, "mixed_precision": None, "mesh": "1d", "cpu_offload": False,
                  "reshard_after_backward": True, "scaler": False, "ac": None, "placement": None}


def _renumbered(p: Program, model: dict, kept: list[int]) -> Program:
    """``p`` with ``model``, whose blocks are ``p``'s blocks ``kept`` (in order): every path that names a block
    (frozen, wrapped by hand, ignored) follows it to its new place, and a path to a dropped block goes."""
    old, new = block_paths(p.model), block_paths(model)
    rename = {old[i]: new[j] for j, i in enumerate(kept)}

    def follow(paths):
        out = []
        for path in paths:
            head = next((o for o in old if path == o or path.startswith(o + ".")), None)
            if head is None:
                out.append(path)
            elif head in rename:
                out.append(rename[head] + path[len(head):])
        return out

    repeat = p.model.get("repeat")
    model = dict(model, frozen=follow(p.model.get("frozen", [])),
                 repeat=kept.index(repeat) if repeat in kept else None)
    wrap = dict(p.wrap, manual=follow(p.wrap.get("manual", [])), ignored=follow(p.wrap.get("ignored", [])))
    return p.replace(model=model, wrap=wrap)


def _without_block(p: Program, i: int) -> Program | None:
    blocks = p.model["blocks"]
    if len(blocks) < 2:
        return None
    kept = [j for j in range(len(blocks)) if j != i]
    return _renumbered(p, dict(p.model, blocks=[blocks[j] for j in kept]), kept)


def simplifications(p: Program) -> list[Program]:
    """Every program one change simpler than ``p``, the biggest reductions first."""
    out: list[Program | None] = []
    hybrid = "HYBRID" in p.options.get("sharding_strategy", "") or p.options.get("mesh") == "2d"
    if not hybrid:
        out += [p.replace(world_size=n) for n in (2, 1) if n < p.world_size]
    out += [p.replace(steps=p.steps[:i] + p.steps[i + 1:]) for i in range(len(p.steps)) if len(p.steps) > 1]
    out += [_without_block(p, i) for i in range(len(p.model["blocks"]))]
    defaults = FSDP1_DEFAULTS if p.impl == "fsdp1" else FSDP2_DEFAULTS
    for key, default in defaults.items():
        if p.options.get(key) != default and not (key == "sharding_strategy" and hybrid) and key != "mesh":
            out.append(p.replace(options=dict(p.options, **{key: default})))
    mp = p.options.get("mixed_precision")
    for key, value in (mp or {}).items():
        if value not in (None, False):
            simpler = False if value is True else None
            out.append(p.replace(options=dict(p.options, mixed_precision=dict(mp, **{key: simpler}))))
    if p.model["container"] != "sequential":  # the paths follow: blocks.b1 becomes blocks.1
        out.append(_renumbered(p, dict(p.model, container="sequential"), list(range(len(p.model["blocks"])))))
    for key, simple in (("out", "tensor"), ("input", "dense"), ("tie", False), ("repeat", None), ("frozen", [])):
        if p.model.get(key) != simple and not (key == "input" and p.model.get("tie")):
            out.append(p.replace(model=dict(p.model, **{key: simple})))
    for i, b in enumerate(p.model["blocks"]):
        for key, simple in (("ret", "tensor"), ("kind", "linear")):
            if b.get(key) != simple and not (key == "kind" and b.get("kind") == "nested"):
                blocks = [dict(x) for x in p.model["blocks"]]
                blocks[i][key] = simple
                out.append(p.replace(model=dict(p.model, blocks=blocks)))
        if b.get("kind") == "nested" and len(b.get("children", [])) > 1:
            for j in range(len(b["children"])):
                blocks = [dict(x) for x in p.model["blocks"]]
                blocks[i]["children"] = b["children"][:j] + b["children"][j + 1:]
                out.append(p.replace(model=dict(p.model, blocks=blocks)))
    for key, simple in (("ignored", []), ("policy", "module"), ("classes", ["Block"]), ("explicit_prefetch", False)):
        if key in p.wrap and p.wrap[key] != simple:
            out.append(p.replace(wrap=dict(p.wrap, **{key: simple})))
    if p.optimizer.get("groups"):
        out.append(p.replace(optimizer=dict(p.optimizer, groups=False)))
    for i, step in enumerate(p.steps):  # a step's own options back to the plainest
        for key, simple in (("clip", None), ("norm_type", 2.0), ("load", False), ("edit", False),
                            ("with_grads", False), ("async_op", False), ("offload", False), ("rank0_only", False)):
            if key in step and step[key] != simple:
                out.append(p.replace(steps=p.steps[:i] + [dict(step, **{key: simple})] + p.steps[i + 1:]))
    for path in p.wrap.get("manual", []):
        out.append(p.replace(wrap=dict(p.wrap, manual=[x for x in p.wrap["manual"] if x != path])))
    return [c for c in out if c is not None]


def _shows(outcome: Outcome, field: str) -> bool:
    return any(d[0] == field for d in outcome.unexplained)


def shrink(program: Program, field: str, rounds: int = 30, log=None) -> Program:
    """The smallest program reachable one simplification at a time that still differs in ``field``."""
    current = program
    for _ in range(rounds):
        candidates = simplifications(current)
        if not candidates:
            break
        by_world: dict[int, list[Program]] = {}
        for c in candidates:
            by_world.setdefault(c.world_size, []).append(c)
        shown = {}
        for group in by_world.values():
            for outcome in run_batch(group):
                shown[id(outcome.program)] = _shows(outcome, field)
        kept = next((c for c in candidates if shown.get(id(c))), None)
        if kept is None:
            break
        current = kept
        if log is not None:
            log(f"shrunk to: {current.summary()}")
    return current
