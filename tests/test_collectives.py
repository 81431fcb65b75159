"""Chapter 2.2: our hand-written collectives against exact sums and against gloo.

All multi-rank checks run in ONE spawn of 8 ranks (a module fixture; each spawn costs
seconds on a laptop); world sizes 1..8 are subgroups.  The worker code and the oracles
are described in tests/_workers_collectives.py.  The ring simulation needs no ranks.
"""

import pytest
import torch

import minifsdp
from minifsdp.comm import collectives as C
from minifsdp.comm.ring_sim import RingStep, print_ring, simulate_ring_all_reduce
from tests import _workers_collectives as W


@pytest.fixture(scope="module")
def report():
    return minifsdp.spawn(W.run_all, world_size=8, timeout_s=150)


@pytest.mark.timeout(200)
@pytest.mark.parametrize(
    "check",
    [
        "exact",  # ring and naive all-reduce, N = 1..8, every size, 4 dtypes, sum and avg: bitwise
        "pieces",  # 5 MB all-reduces, chunks in pipelined pieces, N = 2, 3, 4: sum and avg bitwise
        "rs_ag",  # reduce-scatter and all-gather vs exact and vs gloo: bitwise
        "random_floats",  # random data: the summation error bound; fp32 vs gloo at rtol 1e-5
        "async",  # outstanding async collectives, FIFO order, a sync one behind them
        "bytes",  # 2(N-1)/N x S per rank for the ring, (N-1) x S at the naive root
        "errors",  # clear errors, raised on every rank, no hang
        "carry_room",  # 2 ranks: header buffers sized by the largest all-reduce (FSDP: 64 B), later ones carried
        "facade",  # get_collectives("ring") and ("torch") agree
    ],
)
def test_collectives_on_8_ranks(report, check):
    failures = [f"rank {r}: {line}" for r, rank_report in enumerate(report) for line in rank_report[check]]
    assert not failures, "\n".join(failures[:20])


def test_collective_before_init_says_how_to_fix():
    with pytest.raises(RuntimeError, match="init_process_group"):
        C.ring_all_reduce(torch.ones(3))
    with pytest.raises(RuntimeError, match="minifsdp.spawn"):
        C.ring_reduce_scatter(torch.ones(1), torch.ones(2))


@pytest.mark.parametrize("numel,n,sizes", [(10, 4, [3, 3, 2, 2]), (3, 5, [1, 1, 1, 0, 0]), (0, 3, [0, 0, 0]),
                                           (8, 4, [2, 2, 2, 2]), (7, 1, [7])])
def test_chunk_bounds(numel, n, sizes):
    bounds = C.chunk_bounds(numel, n)
    assert [stop - start for start, stop in bounds] == sizes
    assert bounds[0][0] == 0 and bounds[-1][1] == numel
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))  # contiguous, no gaps


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("numel", [0, 1, 5, 12])
def test_ring_sim_equals_the_sum(n, numel):
    tensors = [torch.randint(-9, 10, (numel,)).float() for _ in range(n)]
    trace = simulate_ring_all_reduce(tensors)
    exact = torch.stack(tensors).sum(0) if numel else torch.zeros(0)
    for result in trace.results:
        assert torch.equal(result, exact)  # small integers: exact in fp32 in any order
    for rank in range(n):  # every rank sends 2(N-1) messages: N-1 per phase
        sent = [s for s in trace.steps if s.sender == rank]
        assert len(sent) == 2 * (n - 1)
        assert [s.phase for s in sent] == ["reduce-scatter"] * (n - 1) + ["all-gather"] * (n - 1)
        assert all(s.receiver == (rank + 1) % n for s in sent)
    assert all(isinstance(s, RingStep) for s in trace.steps)


def test_ring_sim_contributors_grow_by_one_per_step():
    trace = simulate_ring_all_reduce([torch.full((4,), float(r)) for r in range(4)])
    for s in trace.steps:
        want = s.step + 1 if s.phase == "reduce-scatter" else 4  # rank r sends r's partial sum ...
        assert len(s.contributors) == want, s


def test_print_ring_shows_every_step(capsys):
    text = print_ring(simulate_ring_all_reduce([torch.tensor([1.0, 2.0, 3.0]) * (r + 1) for r in range(3)]))
    assert "reduce-scatter step 0" in text and "all-gather step 1" in text
    assert "[6.0, 12.0, 18.0]" in capsys.readouterr().out
