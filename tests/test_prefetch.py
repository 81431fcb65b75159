"""Prefetching and rate limiting (issue 4, section 1): earlier all-gathers, the same numbers.

One spawn (2 ranks, TinyGPT, blocks wrapped, 4 AdamW steps) trains every setting
with a tracer attached; the tests read the summaries.

Oracles and tolerance, all BITWISE (losses, each rank's local shards, full parameters):
* torch FSDP1 with the same ``backward_prefetch`` / ``forward_prefetch`` /
  ``limit_all_gathers`` (and bf16 MixedPrecision for "fwd+pre");
* ours without any prefetch: a prefetch only moves when an all-gather is issued.
The order: the all-gathers issued, and which of them were prefetches, must be
torch FSDP1's rule (forward: the first iteration's pre-forward order, from the second
iteration on; backward: the post-forward order reversed).
"""

import numpy as np
import pytest

import minifsdp
from minifsdp.fsdp.prefetch import BackwardPrefetch, ExecutionOrder
from tests import _workers_overlap as W


@pytest.fixture(scope="module")
def runs():
    return minifsdp.spawn(W.prefetch_worker, world_size=2, timeout_s=240)


def _same(a, b, with_full=True):
    assert a["losses"] == b["losses"]
    for x, y in zip(a["shards"], b["shards"]):
        assert np.array_equal(x, y)
    if with_full:
        for name, y in b["full"].items():
            assert np.array_equal(a["full"][name], y), name


KEYS = [("FULL_SHARD", n) for n in W.PREFETCH_SETTINGS] + [("SHARD_GRAD_OP", "none"), ("SHARD_GRAD_OP", "fwd+pre")]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("key", KEYS)
def test_bitwise_vs_torch_fsdp1_same_prefetch(runs, key):
    for res in runs:
        _same(res[key]["ours"], res[key]["torch"])


def test_prefetch_never_changes_results(runs):
    for res in runs:
        base = res[("FULL_SHARD", "none")]["ours"]
        for name in ("pre", "post", "fwd+post,nolimit"):
            _same(res[("FULL_SHARD", name)]["ours"], base)


STEP_NONE = [("root", False), ("blocks.0", False), ("blocks.1", False), ("blocks.1", False), ("blocks.0", False)]
# BACKWARD_PRE: the root's pre-backward prefetches blocks.1, blocks.1's prefetches blocks.0
STEP_PRE = STEP_NONE[:3] + [("blocks.1", True), ("blocks.0", True)]
# BACKWARD_POST: the root's post-backward runs last, so blocks.1 is gathered on demand
STEP_POST = STEP_NONE[:3] + [("blocks.1", False), ("blocks.0", True)]
# forward prefetch from the 2nd iteration on, in the recorded pre-forward order
STEP_FWD = [("root", False), ("blocks.0", True), ("blocks.1", True)]


def test_issue_order_follows_recorded_execution_order(runs):
    for res in runs:
        steps = W.STEPS
        assert res[("FULL_SHARD", "none")]["ours"]["issued"] == STEP_NONE * steps
        assert res[("FULL_SHARD", "pre")]["ours"]["issued"] == STEP_PRE * steps
        assert res[("FULL_SHARD", "post")]["ours"]["issued"] == STEP_POST * steps
        fwd = res[("FULL_SHARD", "fwd+pre")]["ours"]["issued"]
        assert fwd == STEP_PRE + (STEP_FWD + STEP_PRE[3:]) * (steps - 1)


def test_limit_all_gathers(runs):
    for res in runs:
        for name in ("pre", "post", "fwd+pre"):
            assert res[("FULL_SHARD", name)]["ours"]["max_alive"] <= 2
        assert res[("FULL_SHARD", "none")]["ours"]["max_alive"] == 1  # one block gathered at a time


def test_tracer_records_waits(runs):
    for res in runs:
        exposed = res[("FULL_SHARD", "pre")]["ours"]["exposed"]
        assert set(exposed) == {"all-gather", "reduce-scatter"} and all(v >= 0 for v in exposed.values())


def test_gantt_chrome_trace_and_profiler(runs):
    for res in runs:
        files = res["trace_files"]
        assert files["png_bytes"] > 1000
        assert files["kinds"] == ["all-gather issued", "all-gather wait", "backward", "forward",
                                  "reduce-scatter issued", "reduce-scatter wait"]
        assert files["profiler_has_ours"]  # our spans are record_function ranges
        assert files["profiler_has_gloo"]  # next to torch's own collective ops


def test_execution_order_unit():
    order = ExecutionOrder()
    a, b, c = "a", "b", "c"
    for u in (a, b, c):
        order.record_pre_forward(u)
    assert order.next_in_forward(a) is None  # not before the first iteration has ended
    for u in (b, c, a):
        order.record_post_forward(u)
    assert order.next_in_backward(a) == c and order.next_in_backward(c) == b and order.next_in_backward(b) is None
    order.end_iteration()
    order.record_pre_forward("d")  # the order is fixed after the first iteration
    assert order.pre_forward == [a, b, c] and order.next_in_forward(a) == b and order.next_in_forward(c) is None
    assert order.post_forward == []
    assert BackwardPrefetch.BACKWARD_PRE is not BackwardPrefetch.BACKWARD_POST


def _fake_unit(unsharded: bool):
    """A stand-in for an FSDP unit: just the fields prefetch() and alive_units() read."""
    from types import SimpleNamespace

    from minifsdp.fsdp.state import HandleState, TrainingState

    handle = SimpleNamespace(sharded=True, state=HandleState.UNSHARDED if unsharded else HandleState.SHARDED,
                             started=0)

    def start_unshard(prefetch):
        handle.state = HandleState.GATHERING
        handle.started += 1

    handle.start_unshard = start_unshard
    return SimpleNamespace(_handle=handle, training_state=TrainingState.AWAITING_BACKWARD)


@pytest.mark.parametrize("limit", [True, False])
def test_limit_all_gathers_refuses_a_third_unit(limit):
    """The rate limiter itself: with two units already gathered, a third prefetch waits (limit on) or goes."""
    from types import SimpleNamespace

    from minifsdp.fsdp.prefetch import alive_units, prefetch

    a, b, c = _fake_unit(True), _fake_unit(True), _fake_unit(False)
    root = SimpleNamespace(_handle=None)
    units = [root, a, b, c]  # the root first, as units.units(root) lists them
    assert alive_units(units) == 2
    issued = prefetch(c, units, limit, in_backward=False)
    assert issued is (not limit) and c._handle.started == (0 if limit else 1)
    assert alive_units(units) == (2 if limit else 3)
