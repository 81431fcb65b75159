"""The %%ranks cell magic: cell text runs on real ranks, output comes back grouped.

Oracle: arithmetic done by hand (the all_reduce of rank+1 over 2 ranks is 3).
Each test is one `spawn` (about 3 s on 2 cores); the file stays under 30 s.
"""

import pytest

from minifsdp.notebook import RankCellError, format_outputs, run_on_ranks

CELL = """
t = torch.tensor([rank + 1.0, 10.0 * (rank + 1)])
dist.all_reduce(t)
print(f"hello from {rank} of {world_size}", offset)
import sys
print("to stderr", file=sys.stderr)
result = {"rank": rank, "sum": t}
"""


@pytest.mark.timeout(60)
def test_run_on_ranks_all_reduce_results_and_output():
    runs = run_on_ranks(CELL, world_size=2, push={"offset": 7})
    assert [r.rank for r in runs] == [0, 1]
    for r in runs:
        assert r.output == f"hello from {r.rank} of 2 7\nto stderr\n"
        assert r.result["rank"] == r.rank
        assert r.result["sum"].tolist() == [3.0, 30.0]  # (1 + 2), (10 + 20): exact in fp32
    assert format_outputs(runs) == (
        "[rank 0] hello from 0 of 2 7\n[rank 0] to stderr\n[rank 1] hello from 1 of 2 7\n[rank 1] to stderr\n"
    )


def test_push_rejects_unpicklable_values_before_spawning():
    with pytest.raises(TypeError, match="cannot push 'f'"):
        run_on_ranks("pass", world_size=2, push={"f": lambda x: x})


@pytest.mark.timeout(60)
def test_failing_rank_is_named_with_its_cell_traceback():
    cell = "print('before')\nif rank == 1:\n    raise ValueError('boom on purpose')\ndist.barrier()\n"
    with pytest.raises(RankCellError) as info:
        run_on_ranks(cell, world_size=2, timeout_s=30)
    err = info.value
    assert err.rank == 1
    assert err.report.startswith("before\n")  # what the rank printed before it failed
    assert "line 3" in err.report and "raise ValueError('boom on purpose')" in err.report  # the cell's own line
    assert "ValueError: boom on purpose" in err.report
    assert "_run_cell" not in err.report and "launch.py" not in err.report  # only the cell's frames


def test_magic_in_an_ipython_shell(capsys, monkeypatch):
    """Registration, option parsing, --push and -o, without spawning (run_on_ranks is tested above)."""
    pytest.importorskip("IPython")
    from IPython.core.interactiveshell import InteractiveShell

    import minifsdp.notebook as nb

    calls = []

    def fake_run_on_ranks(source, world_size, push, timeout_s):
        calls.append((source, world_size, push, timeout_s))
        return [nb.RankRun(r, f"r {r}\n", r * push["scale"]) for r in range(world_size)]

    monkeypatch.setattr(nb, "run_on_ranks", fake_run_on_ranks)
    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "minifsdp.notebook")
    shell.user_ns["scale"] = 2.0
    res = shell.run_cell("%%ranks -n 3 -o got --timeout 9 --push scale\nresult = rank * scale\n")
    assert res.error_in_exec is None and res.error_before_exec is None
    assert calls == [("result = rank * scale\n", 3, {"scale": 2.0}, 9.0)]
    assert shell.user_ns["got"] == [0.0, 2.0, 4.0]
    assert capsys.readouterr().out == "[rank 0] r 0\n[rank 1] r 1\n[rank 2] r 2\n"
    bad = shell.run_cell("%%ranks --push nope\npass\n")
    assert "no notebook variable named 'nope'" in str(bad.error_in_exec)


def test_viz_ring_replay_matches_the_simulated_buffers():
    """Oracle: minifsdp.comm.ring_sim's buffers.  Rank r contributes 2**r everywhere, so a
    chunk's value names exactly whose data it holds; plots.py's replay of the step records
    must say the same after every step (exact: small integers in fp32)."""
    import matplotlib

    matplotlib.use("Agg")
    import torch

    from minifsdp.comm.ring_sim import simulate_ring_all_reduce
    from minifsdp.pictures import plots

    n = 4
    trace = simulate_ring_all_reduce([torch.full((8,), 2.0**r) for r in range(n)])
    states = plots.ring_states(trace)
    assert len(states) == len(trace.states) == 2 * (n - 1) + 1  # start + reduce-scatter + all-gather rounds
    for state, buffers in zip(states, trace.states):
        for r in range(n):
            for c, (lo, hi) in enumerate(trace.bounds):
                expected = float(sum(2**k for k in state["holds"][r][c]))
                assert buffers[r].reshape(-1)[lo:hi].tolist() == [expected] * (hi - lo), (state["title"], r, c)
    assert all(h == set(range(n)) for row in states[-1]["holds"] for h in row)
    fig = plots.plot_ring_steps(trace)
    assert len([ax for ax in fig.axes if ax.patches]) == len(states)  # one drawn grid per round
    with pytest.raises(ValueError, match="phase"):
        plots.ring_states([{"phase": "broadcast", "step": 0, "sender": 0, "receiver": 1, "chunk": 0}])
