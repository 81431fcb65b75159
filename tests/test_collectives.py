"""Chapter 2.2: our hand-written collectives, the textbook ring and the tuned one, on 8 real ranks over gloo.

Every multi-rank check runs in ONE spawn of 8 processes (a module fixture; each spawn costs
seconds on a laptop); world sizes 1..8 are subgroups.  The worker code and the oracles are
described in tests/_workers_collectives.py.  The ring's one-process checks (chunk rule, schedule,
simulation, both rings on thread-ranks) are in tests/comm/, which runs before this file.
"""

import pytest

import minifsdp
from tests import _workers_collectives as W


# ----------------------------------------------------------------------------- 8 real ranks on gloo
@pytest.fixture(scope="module")
def report():
    return minifsdp.spawn(W.run_all, world_size=8, timeout_s=150)


@pytest.mark.timeout(200)
@pytest.mark.parametrize(
    "check",
    [
        "exact",  # tuned, textbook and naive all-reduce, N = 1..8, every size, 4 dtypes, sum and avg: bitwise
        "pieces",  # 5 MB all-reduces, chunks in pipelined pieces, N = 2, 3, 4: sum and avg bitwise
        "tuned_vs_textbook",  # random data, N = 2, 3, 4, sizes no N divides, sum/avg, 4 dtypes: bitwise
        "rs_ag",  # reduce-scatter and all-gather vs exact and vs gloo: bitwise
        "random_floats",  # random data: the summation error bound; fp32 vs gloo at rtol 1e-5
        "async",  # outstanding async collectives, FIFO order, a sync one behind them
        "bytes",  # 2(N-1)/N x S per rank for both rings, (N-1) x S at the naive root
        "errors",  # clear errors, raised on every rank, no hang
        "textbook_errors",  # the same for the textbook ring
        "carry_room",  # 2 ranks: header buffers sized by the largest all-reduce (FSDP: 64 B), later ones carried
        "facade",  # get_collectives("ring"), ("textbook") and ("torch") agree
    ],
)
def test_collectives_on_8_ranks(report, check):
    failures = [f"rank {r}: {line}" for r, rank_report in enumerate(report) for line in rank_report[check]]
    assert not failures, "\n".join(failures[:20])
