"""Parent side of the port: one spawn per (group module, world size) for all its selected cases.

Process start-up (spawn, import torch) costs seconds on a laptop, a case costs milliseconds, so the
cases a pytest session selected from one module run in one spawned batch (:func:`run_batch`).  If
the batch dies (a rank crashed or hung), the ranks' progress logs say which cases finished and which
side of which case was running: that case gets the death as its result, and the rest run on in a
new batch, so one crash costs one case and says which side died.  A case that fails on some ranks while
the others wait for them in a collective ends its batch the same way, within seconds, with every rank's
traceback (``_agree.py``).

:func:`check` turns a case's result into pytest's outcome: torch FSDP1 failed on CPU -> skip (not
counted), ours failed -> fail (xfail where the module marks the gap), both passed -> pass.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

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


def _read_logs(log: str, world: int) -> list[list[dict]]:
    out = []
    for r in range(world):
        try:
            with open(f"{log}.{r}") as f:
                out.append([json.loads(line) for line in f if line.strip()])
        except (OSError, ValueError):
            out.append([])
    return out


def _run(module: str, ids: list[str], world: int) -> dict:
    """Run ``ids`` in batches; when a batch dies, keep what finished, blame the side that was running, go on."""
    out: dict = {}
    todo = list(ids)
    with tempfile.TemporaryDirectory() as tmp:
        attempt = 0
        while todo:
            attempt += 1
            log = os.path.join(tmp, f"log{attempt}")
            try:
                per_case = getattr(sys.modules.get(module), "SECONDS_PER_CASE", 3.0)  # a module may need more
                per_rank = spawn(W.run_batch, (module, todo, ("torch", "ours"), log), world_size=world,
                                 timeout_s=90.0 + per_case * len(todo))
                out.update(_merge(per_rank, todo))
                return out
            except RankFailedError as e:
                logs = _read_logs(log, world)
                done = {}
                for entries in logs:
                    for ent in entries:
                        if "done" in ent:
                            done.setdefault(ent["done"], []).append(ent["res"])
                finished = [c for c in todo if len(done.get(c, [])) == world]
                out.update(_merge([{c: done[c][r] for c in finished} for r in range(world)], finished))
                starts = [ent for ent in logs[e.rank] if "start" in ent] if e.rank < len(logs) else []
                lines = [ln for ln in e.detail.strip().splitlines() if ln.strip()]
                why = f"rank {e.rank} died: {lines[-1] if lines else '?'}"[:300]
                rest = [c for c in todo if c not in finished]
                if not rest:
                    return out
                left = [ent for entries in logs for ent in entries if "left_waiting" in ent]
                if left:  # a rank failed while the others waited in a collective: it ended the batch, named it
                    dead, side = left[0]["left_waiting"], left[0]["side"]
                    res = {side: left[0]["why"], side + "_tb": left[0]["tb"]}
                else:
                    dead = starts[-1]["start"] if starts and starts[-1]["start"] in rest else rest[0]
                    side = starts[-1]["side"] if starts and starts[-1]["start"] == dead else "torch"
                    res = {side: why}
                if side == "ours":  # torch's side of this case finished: its result is in the logs
                    errs = [ent["err"] for entries in logs for ent in entries
                            if ent.get("ended") == dead and ent["side"] == "torch"]
                    res["torch"] = next((x for x in errs if x), None)
                out[dead] = res
                todo = [c for c in rest if c != dead]
    return out


def result(module: str, cid: str) -> dict:
    cases = sys.modules[module].CASES
    world = cases[cid].world
    key = (module, world)
    if key not in _RESULTS:
        ids = [c for c in SELECTED.get(module, []) if cases[c].world == world] or [cid]
        _RESULTS[key] = _run(module, ids, world)
    if cid not in _RESULTS[key]:
        _RESULTS[key].update(_run(module, [cid], world))
    return _RESULTS[key][cid]


def check(module: str, cid: str) -> None:
    res = result(module, cid)
    if res.get("torch"):
        pytest.skip(f"torch FSDP1 fails on CPU: {res['torch']}")
    if res.get("ours"):
        pytest.fail(f"{res['ours']}\n{res.get('ours_tb', '')}", pytrace=False)
