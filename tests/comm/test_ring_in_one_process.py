"""Chapter 2.2: the ring checked in one process, in seconds -- before any test that spawns ranks.

This folder sorts before every other test file, so in a whole-suite run these come first: a
wrong chunk index fails here, not after a multi-rank spawn has waited out its timeout.
1. the chunking rule, the schedule, and the ring simulation (no ranks at all);
2. the real ring code -- textbook and tuned -- on N threads of this process standing in for ranks
   (tests/comm/_ring_threads.py: an in-memory mailbox that matches messages as gloo does).
The same collectives on 8 real processes over gloo: tests/test_collectives.py.
"""

import pytest
import torch

from minifsdp.comm import collectives as C
from minifsdp.comm import ring as textbook
from minifsdp.comm.ring_sim import RingStep, print_ring, simulate_ring_all_reduce
from tests.comm._ring_threads import run_ranks

# The student edition cuts the textbook ring out of its library and runs the student's there (task 2.2,
# minifsdp/learner.py): what only the library's own ring promises is not asked of theirs.
LIBRARY_RING = pytest.mark.skipif("cut from the student edition" in (textbook.ring_all_reduce.__doc__ or ""),
                                  reason="the student edition: the textbook ring is yours (task 2.2); its argument "
                                         "checks and the tuned ring's bits for any size are the library's own")


# ----------------------------------------------------------------------------- no ranks
@pytest.mark.parametrize("numel,n,sizes", [(10, 4, [3, 3, 2, 2]), (3, 5, [1, 1, 1, 0, 0]), (0, 3, [0, 0, 0]),
                                           (8, 4, [2, 2, 2, 2]), (7, 1, [7])])
def test_chunk_bounds(numel, n, sizes):
    bounds = C.chunk_bounds(numel, n)
    assert [stop - start for start, stop in bounds] == sizes
    assert bounds[0][0] == 0 and bounds[-1][1] == numel
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))  # contiguous, no gaps


@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_every_rank_sends_what_the_next_one_expects(n):
    """The schedule itself: at every step of both phases, the chunk rank r sends is the chunk rank r+1
    receives; each phase visits every chunk once per rank; the reduce-scatter ends on our own chunk."""
    for chunks_at in (textbook.reduce_scatter_chunks, textbook.all_gather_chunks):
        for rank in range(n):
            steps = [chunks_at(rank, n, s) for s in range(n - 1)]
            assert [send for send, _ in steps] == [chunks_at((rank + 1) % n, n, s)[1] for s in range(n - 1)]
            assert len({recv for _, recv in steps}) == n - 1  # no chunk received twice
    for rank in range(n):
        assert textbook.reduce_scatter_chunks(rank, n, n - 2)[1] == rank  # rank r ends owning chunk r
        assert textbook.all_gather_chunks(rank, n, 0)[0] == rank  # ... and starts the all-gather with it


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("numel", [0, 1, 5, 12])
def test_ring_sim_equals_the_sum(n, numel):
    tensors = [torch.randint(-9, 10, (numel,)).float() for _ in range(n)]
    trace = simulate_ring_all_reduce(tensors)
    exact = torch.stack(tensors).sum(0) if numel else torch.zeros(0)
    assert len(trace.results) == n
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


@LIBRARY_RING
def test_collective_before_init_says_how_to_fix():
    with pytest.raises(RuntimeError, match="init_process_group"):
        C.ring_all_reduce(torch.ones(3))
    with pytest.raises(RuntimeError, match="minifsdp.spawn"):
        C.ring_reduce_scatter(torch.ones(1), torch.ones(2))
    with pytest.raises(RuntimeError, match="init_process_group"):
        textbook.ring_all_reduce(torch.ones(3))


def test_get_collectives_names_every_kind():
    assert C.COLLECTIVE_KINDS == ("ring", "textbook", "torch")
    assert [C.get_collectives(kind).kind for kind in C.COLLECTIVE_KINDS] == list(C.COLLECTIVE_KINDS)
    with pytest.raises(ValueError, match="'ring'.*'textbook'.*'torch'"):
        C.get_collectives("nccl")


# ----------------------------------------------------------------------------- thread-ranks, one process
def _small_ints(rank: int, numel: int) -> torch.Tensor:
    return torch.randint(-8, 9, (numel,), generator=torch.Generator().manual_seed(100 * rank + numel)).float()


def _textbook_all_three(group, numel: int) -> list[torch.Tensor]:
    n, r = group.size, group.rank
    x = _small_ints(r, numel)
    summed, mean = x.clone(), x.clone()
    textbook.ring_all_reduce(summed, group=group)
    textbook.ring_all_reduce(mean, op="avg", group=group)
    shard = torch.full((numel,), -1.0)
    textbook.ring_reduce_scatter(shard, _small_ints(r, n * numel), group=group)
    gathered = torch.full((n * numel,), -1.0)
    textbook.ring_all_gather(gathered, x, group=group)
    return [summed, mean, shard, gathered]


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("numel", [0, 1, 7, 37])  # empty, fewer than N, sizes most N do not divide
def test_textbook_ring_on_thread_ranks_gives_the_exact_results(n, numel):
    results = run_ranks(_textbook_all_three, n, (numel,))
    assert len(results) == n
    total = sum(_small_ints(r, numel) for r in range(n))
    total_rs = sum(_small_ints(r, n * numel) for r in range(n))
    gathered = torch.cat([_small_ints(r, numel) for r in range(n)])
    for r, (summed, mean, shard, got) in enumerate(results):
        assert torch.equal(summed, total), f"rank {r}: all-reduce sum"
        assert torch.equal(mean, total / n), f"rank {r}: all-reduce avg"
        assert torch.equal(shard, total_rs[r * numel:(r + 1) * numel]), f"rank {r}: reduce-scatter"
        assert torch.equal(got, gathered), f"rank {r}: all-gather"


def _both_rings(group, numel: int, dtype: torch.dtype, op: str) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * group.rank + numel)
    x = (torch.randn(numel, generator=gen) * 100).to(dtype) if dtype.is_floating_point \
        else torch.randint(-(2**40), 2**40, (numel,), generator=gen)
    out = []
    for all_reduce in (textbook.ring_all_reduce, C.ring_all_reduce, C.ring_all_reduce):  # N=2: swapped, carried
        t = x.clone()
        all_reduce(t, op=op, group=group)
        out.append(t)
    m = numel // group.size
    for reduce_scatter in (textbook.ring_reduce_scatter, C.ring_reduce_scatter):
        shard = torch.empty(m, dtype=dtype)
        reduce_scatter(shard, x[: m * group.size], op=op, group=group)
        out.append(shard)
    return out


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("dtype,op", [(d, op) for d in (torch.float32, torch.float16, torch.bfloat16)
                                      for op in ("sum", "avg")] + [(torch.int64, "sum")])  # int avg raises
@LIBRARY_RING
def test_tuned_ring_on_thread_ranks_is_bitwise_the_textbook(n, dtype, op):
    """Random data (every rounding counts); 1001 and 5 x 2**18 + 5 elements: no world size divides them,
    and the second moves in pipelined pieces.  The multi-rank twin on gloo: tests/test_collectives.py,
    check "tuned_vs_textbook"."""
    for numel in (1001, 5 * (1 << 18) + 5):
        results = run_ranks(_both_rings, n, (numel, dtype, op))
        assert len(results) == n
        for r, (book, tuned, tuned_again, book_rs, tuned_rs) in enumerate(results):
            assert torch.equal(book, tuned) and torch.equal(book, tuned_again), f"rank {r}, {numel}: all-reduce"
            assert torch.equal(book_rs, tuned_rs), f"rank {r}, {numel}: reduce-scatter"
            assert torch.equal(book, results[0][0]), f"rank {r}, {numel}: not the same bits as rank 0"
