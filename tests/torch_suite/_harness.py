"""Parent side of the port: one spawn per (group module, world size) for all its selected cases.

Process start-up (spawn, import torch) costs seconds on a laptop, a case costs milliseconds, so the
cases a pytest session selected from one module run in one spawned batch (:func:`run_batch`).  If
the batch dies (a rank crashed or hung), each of its cases reruns alone, torch's side and ours in
separate spawns, so one crash costs one case, and says which side died.

:func:`check` turns a case's result into pytest's outcome: torch FSDP1 failed on CPU -> skip (not
counted), ours failed -> fail (xfail where the module marks the gap), both passed -> pass.
"""

from __future__ import annotations

import sys

import pytest

from minifsdp import RankFailedError, spawn
from tests.torch_suite import _workers as W

SELECTED: dict[str, list[str]] = {}  # module -> case ids this session runs (filled by conftest)
_RESULTS: dict[tuple, dict] = {}


def params(cases: W.Cases, xfail: dict | None = None, fast: tuple = ()) -> list:
    """pytest params for ``cases``: ``xfail`` maps an id (or an id's prefix ending in ':') to the gap's one-line
    reason, strict; ids in ``fast`` get the ``fast`` mark (the CI slice)."""
    out = []
    for cid in cases:
        marks = []
        for key, reason in (xfail or {}).items():
            if cid == key or (key.endswith((":", ",")) and cid.startswith(key)) or (callable(key) and key(cid)):
                marks.append(pytest.mark.xfail(strict=True, reason=reason))
                break
        if cid in fast:
            marks.append(pytest.mark.fast)
        out.append(pytest.param(cid, marks=marks, id=cid))
    return out


def _merge(per_rank: list[dict], ids: list[str]) -> dict:
    out = {}
    for cid in ids:
        res = {}
        for side in ("torch", "ours"):
            errs = [(r, d[cid].get(side)) for r, d in enumerate(per_rank) if side in d[cid]]
            if not errs:
                continue
            bad = [(r, e) for r, e in errs if e]
            res[side] = f"rank {bad[0][0]}: {bad[0][1]}" if bad else None
            tbs = [d[cid].get(side + "_tb") for d in per_rank if d[cid].get(side + "_tb")]
            if tbs:
                res[side + "_tb"] = tbs[0]
        out[cid] = res
    return out


def _spawn(module: str, ids: list[str], world: int, sides=("torch", "ours"), timeout: float = 120.0) -> dict:
    return _merge(spawn(W.run_batch, (module, ids, sides), world_size=world, timeout_s=timeout), ids)


def _alone(module: str, cid: str, world: int) -> dict:
    res = {}
    for side in ("torch", "ours"):
        try:
            res.update(_spawn(module, [cid], world, (side,), timeout=90.0)[cid])
        except RankFailedError as e:
            lines = [ln for ln in e.detail.strip().splitlines() if ln.strip()]
            res[side] = f"rank {e.rank} died: {lines[-1] if lines else '?'}"[:300]
    return res


def result(module: str, cid: str) -> dict:
    cases = sys.modules[module].CASES
    world = cases[cid].world
    key = (module, world)
    if key not in _RESULTS:
        ids = [c for c in SELECTED.get(module, []) if cases[c].world == world] or [cid]
        try:
            _RESULTS[key] = _spawn(module, ids, world, timeout=60.0 + 15.0 * len(ids))
        except RankFailedError:
            _RESULTS[key] = {c: _alone(module, c, world) for c in ids}
    if cid not in _RESULTS[key]:
        _RESULTS[key][cid] = _alone(module, cid, world)
    return _RESULTS[key][cid]


def check(module: str, cid: str) -> None:
    res = result(module, cid)
    if res.get("torch"):
        pytest.skip(f"torch FSDP1 fails on CPU: {res['torch']}")
    if res.get("ours"):
        pytest.fail(f"{res['ours']}\n{res.get('ours_tb', '')}", pytrace=False)
