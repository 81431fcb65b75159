"""Grades tasks 4.4a-b: ``exercises/parallel_tasks.py`` (``--impl=student``) or the instructor's answer, run in
the learner's process.  No ranks.

Oracles: 4.4a an unsharded ``nn.Linear`` (to 1e-5: the N partial sums add the products in another order)
and, bitwise, the math of our ``RowwiseParallel`` (its own slicing ``tensor_parallel._take`` and
``F.linear`` of the slices, then the sum in rank order and the bias once, as ``_rowwise_forward``; at 2 ranks
that is what tests/test_tensor_parallel.py runs on real ranks).  4.4b torch's own
``Schedule1F1B._step_microbatches`` driven here in one process with a stand-in stage that records what it is
asked to do (no messages: every receive/send list is empty); tests/test_pipelining.py proves our
``action_order("1f1b", ...)`` runs that order on real ranks, but the student edition cuts its 1F1B (the
learner's runs there), so it is no oracle here: the grader's process never runs the learner's code.

Each task first shows its checks rejecting wrong solutions (the bias added on every rank, no all-reduce; the
GPipe order, a warm-up one too long), then grades the implementation.
"""

import functools

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.pipelining import Schedule1F1B as TorchSchedule1F1B

import minifsdp.parallel.tensor_parallel as tp
from minifsdp.parallel.pipeline_schedules import action_order


# ----------------------------------------------------------------------------- the oracles, from the library
def _cut(t, r, world_size):
    """Rank r's columns of ``t`` (its last dimension), as our RowwiseParallel cuts them (``tp._take``)."""
    return tp._take(t, tp.TPShard(t.dim() - 1, r, world_size, 1, tuple(t.shape)))


def _rank_products(x, weight, world_size):
    """Each rank's ``F.linear`` of its slice of the input and its slice of the weight (no communication)."""
    return [F.linear(_cut(x, r, world_size), _cut(weight, r, world_size)) for r in range(world_size)]


def _refuse_bad_stages(stage_index, num_stages, n_microbatches):
    """The checks torch's Schedule1F1B makes (the wrong orders below keep them, so only their order is wrong)."""
    if not 0 <= stage_index < num_stages or n_microbatches < num_stages:
        raise ValueError(f"stage {stage_index} of {num_stages}, {n_microbatches} micro-batches")


def _fn(learner, name):
    return getattr(learner("parallel_tasks"), name)


# ----------------------------------------------------------------------------- 4.4a
def _check_row_parallel(f):
    """Raise AssertionError if ``f`` is not a row-parallel Linear's forward (our RowwiseParallel's math)."""
    g = torch.Generator().manual_seed(0)
    for n, shape, out_f, with_bias in ((2, (4, 8), 6, True), (4, (2, 3, 16), 5, True), (3, (5, 12), 12, False),
                                       (1, (3, 4), 4, True)):
        x = torch.randn(*shape, generator=g)
        lin = torch.nn.Linear(shape[-1], out_f, bias=with_bias)
        with torch.no_grad():
            lin.weight.copy_(torch.randn(lin.weight.shape, generator=g))
            if with_bias:
                lin.bias.copy_(torch.randn(out_f, generator=g))
        w, b = lin.weight.detach().clone(), None if lin.bias is None else lin.bias.detach().clone()
        xc, wc, bc = x.clone(), w.clone(), None if b is None else b.clone()
        partials, outputs = f(x, w, b, n)
        products = _rank_products(x, w, n)
        reduced = functools.reduce(torch.add, products)  # the all-reduce's sum, rank 0's first
        assert torch.equal(x, xc) and torch.equal(w, wc) and (b is None or torch.equal(b, bc)), "inputs modified"
        assert len(partials) == len(outputs) == n, f"{n} ranks: got {len(partials)} partials, {len(outputs)} outputs"
        for r in range(n):
            assert partials[r].shape == outputs[r].shape == (*shape[:-1], out_f), f"rank {r}: shape"
            assert torch.equal(partials[r], products[r]), f"rank {r}'s partial: not x_r @ W_r^T of its slices"
            assert torch.equal(outputs[r], reduced if b is None else reduced + b), \
                f"rank {r}'s output: not sum of partials + bias"
            torch.testing.assert_close(outputs[r], lin(x).detach(), rtol=0, atol=1e-5)
    with pytest.raises(ValueError):
        f(torch.randn(2, 6), torch.randn(3, 6), None, 4)


def _bias_on_every_rank(x, w, b, n):
    products = _rank_products(x, w, n)
    with_bias = [p if b is None else p + b for p in products]  # b added before the sum: N times
    return products, [functools.reduce(torch.add, with_bias)] * n


def _no_all_reduce(x, w, b, n):
    products = _rank_products(x, w, n)
    return products, [p if b is None else p + b for p in products]


def test_task4_4a_row_parallel_linear(learner):
    for wrong in (_bias_on_every_rank, _no_all_reduce):
        with pytest.raises(AssertionError):
            _check_row_parallel(wrong)
    _check_row_parallel(_fn(learner, "row_parallel_linear"))


# ----------------------------------------------------------------------------- 4.4b
class _RecordingStage:
    """What torch's single-stage schedules call on a stage, doing nothing but recording F and B."""

    device = torch.device("cpu")

    def __init__(self, stage_index, num_stages):
        self.stage_index, self.num_stages = stage_index, num_stages
        self.is_first, self.is_last = stage_index == 0, stage_index == num_stages - 1
        self.actions = []

    def forward_one_chunk(self, i, *args, **kwargs):
        self.actions.append(f"F{i}")
        return torch.zeros(())

    def backward_one_chunk(self, i, *args, **kwargs):
        self.actions.append(f"B{i}")

    def get_fwd_recv_ops(self, i):
        return []

    get_fwd_send_ops = get_bwd_recv_ops = get_bwd_send_ops = get_fwd_recv_ops

    def __getattr__(self, name):  # any other bookkeeping call: a no-op
        if name.startswith("__"):
            raise AttributeError(name)
        return lambda *args, **kwargs: None


def _torch_1f1b_order(stage_index, num_stages, n_microbatches):
    """The order torch's own Schedule1F1B runs stage ``stage_index`` in (its code, no ranks)."""
    stage = _RecordingStage(stage_index, num_stages)
    sched = TorchSchedule1F1B(stage, n_microbatches, loss_fn=lambda out, target: out.sum())
    sched._initialize_stage = lambda *args, **kwargs: None  # shape inference needs real neighbours: skipped
    sched._step_microbatches([()] * n_microbatches, [{}] * n_microbatches, [None] * n_microbatches, None)
    return stage.actions


GRID = [(s, p, m) for p in (1, 2, 3, 4, 5) for m in range(p, p + 5) for s in range(p)]


def _check_1f1b(f):
    """Raise AssertionError if ``f`` is not the 1F1B order (torch's) on the whole grid."""
    for s, p, m in GRID:
        got = f(s, p, m)
        assert got == _torch_1f1b_order(s, p, m), f"stage {s} of {p}, {m} micro-batches: {got}"
    for bad in ((0, 4, 3), (4, 4, 8), (-1, 2, 2)):
        with pytest.raises(ValueError):
            f(*bad)


def _gpipe(s, p, m):
    _refuse_bad_stages(s, p, m)
    return action_order("gpipe", s, p, m)


def _warmup_too_long(s, p, m):  # p - s forwards first (torch's warm-up count), then F-then-B pairs
    _refuse_bad_stages(s, p, m)
    w = min(m, p - s)
    steady = [a for i in range(m - w) for a in (f"F{w + i}", f"B{i}")]
    return [f"F{i}" for i in range(w)] + steady + [f"B{i}" for i in range(m - w, m)]


def test_task4_4b_one_f_one_b_order(learner):
    assert _torch_1f1b_order(0, 4, 6) == ["F0", "F1", "F2", "F3", "B0", "F4", "B1", "F5", "B2", "B3", "B4", "B5"]
    for wrong in (_gpipe, _warmup_too_long):
        with pytest.raises(AssertionError):
            _check_1f1b(wrong)
    _check_1f1b(_fn(learner, "one_f_one_b_order"))
