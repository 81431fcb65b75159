"""Chapter 6's explorer (``minifsdp/explorers/pitfall_pair.py``) shows what the library's pitfall runner computes.

Oracle: the chapter's reproductions themselves (``minifsdp/cells/pitfall_runs.py``'s ``clip_cases`` and
``hybrid_cases``), called directly on 2 ranks of their own, and the plain MLP's gradient norm on the whole batch in
this process.  The explorer's facts must equal the runner's **bitwise** (the same seeds, the same gloo sums), its
rows must be built from them, and its clip rows must show what the chapter says (each rank its own norm with the
plain function; the plain model's norm, to 6 digits, with the FSDP method).  Two spawns of 2 ranks: the explorer's
(both pitfalls in one) and the runner's.
"""

import pytest
import torch

import minifsdp
from minifsdp import MLP
from minifsdp.explorers import panel, pitfall_pair
from tests import _workers_pitfalls as W

PITFALLS = ["clip", "hybrid"]


@pytest.fixture(scope="module")
def runs():
    pitfall_pair.RUNS.clear()
    pitfall_pair.run_many(PITFALLS, 2)  # the explorer's own spawn, both pitfalls in one
    return {"explorer": {p: pitfall_pair.RUNS[p, 2] for p in PITFALLS},
            "runner": minifsdp.spawn(W.explorer_oracle_worker, world_size=2, timeout_s=180)}


def _same(a, b) -> bool:
    """Equal facts, tensors bitwise."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


@pytest.mark.timeout(400)
@pytest.mark.parametrize("pitfall", PITFALLS)
def test_the_explorer_shows_what_the_librarys_pitfall_runner_gives(pitfall, runs):
    ours, runner = runs["explorer"][pitfall], [r[pitfall] for r in runs["runner"]]
    assert len(ours) == len(runner) == 2
    assert all(_same(a, b) for a, b in zip(ours, runner, strict=True))
    view = pitfall_pair.compute({"pitfall": pitfall})  # kept from the run above: no spawn
    assert view.rows == pitfall_pair.rows_of(pitfall, runner)
    assert view.why == pitfall_pair.PITFALLS[pitfall][1] and view.section.startswith("Pitfall ")
    if pitfall == "clip":
        x, y = zip(*(MLP().batch(0, 4, r, 2) for r in range(2)))
        plain = MLP()
        sum((plain(a) - b).square().mean() for a, b in zip(x, y, strict=True)).div(2).backward()
        whole = torch.nn.utils.clip_grad_norm_(plain.parameters(), 1e9).item()
        plain_fn, method, oracle = view.rows
        assert plain_fn[1] == plain_fn[2] and method[1] == method[2]  # ours prints what torch printed
        norms = [float(r["torch"][0]) for r in runner]
        assert norms[0] != norms[1] and plain_fn[1] == f"rank 0 {norms[0]:.6f}, rank 1 {norms[1]:.6f}"
        assert method[1] == f"rank 0 {whole:.6f}, rank 1 {whole:.6f}" and oracle[1] == f"{whole:.6f}"
    else:
        assert view.rows[0][1:] == ("False", "True")  # torch's replicas drift, ours agree
        assert view.rows[2][2] == "True"  # bitwise torch's NO_SHARD over both ranks


def test_the_fallback_is_the_default_pitfall_as_computed_and_a_setting_not_run_waits_for_run(runs, capsys):
    text = pitfall_pair.fallback()
    assert text == capsys.readouterr().out.rstrip("\n") and text.endswith(panel.NEEDS_KERNEL)
    assert text == panel.with_kernel_line(pitfall_pair.format_pitfall(pitfall_pair.compute({})))
    with pytest.raises(ValueError, match="pitfall must be one of"):
        pitfall_pair.compute({"pitfall": "hang"})
    with pytest.raises(ValueError, match="N must be one of"):
        pitfall_pair.compute({"world_size": 5})
    pytest.importorskip("ipywidgets")
    box = pitfall_pair.panel()
    assert pitfall_pair.format_pitfall(pitfall_pair.compute({})) in capsys.readouterr().out
    menu, slider, button = box.children[1].children
    assert list(menu.options) == list(pitfall_pair.PITFALLS) and button.description == "run"
    slider.value = 3  # not run at N = 3: the panel waits for the button, it does not spawn
    assert "not run yet; press run" in capsys.readouterr().out and ("clip", 3) not in pitfall_pair.RUNS
