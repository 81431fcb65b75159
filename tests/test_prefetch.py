"""Prefetching and rate limiting (chapter 2.5): earlier all-gathers, the same numbers, torch FSDP1's order.

One spawn (2 ranks, TinyGPT, blocks wrapped, 4 AdamW steps) trains every setting
with a tracer attached; the tests read the summaries.

Oracles and tolerance, all BITWISE (losses, each rank's local shards, full parameters):
* torch FSDP1 with the same ``backward_prefetch`` / ``forward_prefetch`` /
  ``limit_all_gathers`` (and bf16 MixedPrecision for "fwd+pre");
* ours without any prefetch: a prefetch only moves when an all-gather is issued.

The order, EXACT against torch FSDP1's, recorded in the same run (never written by hand):
which unit each all-gather gathers, in issue order, and whether it was a prefetch.  Ours
comes from our tracer's "all-gather issued" events (checked against the c10d ops ours
issued), torch's from the c10d ops it issued (``_workers_overlap.CollectiveLog``: units
named by the all-gather's output storage, since the two blocks have the same flat size;
"prefetch" = issued inside torch's ``_prefetch_handle``).  On CPU torch issues each
all-gather synchronously, so its op order is its issue order.  forward_prefetch + BACKWARD_POST
shows why a forward prefetch makes the target's views (``core/prefetch.py``, Note (views)): from the
2nd step on, blocks.0's pre-backward (an all-gather on demand) runs before blocks.1's post-backward,
whose BACKWARD_POST prefetch then finds nothing to do; with views made in blocks.1's own forward, the
post-backward came first and prefetched blocks.0.

The whole sequence of collectives (all-gathers and reduce-scatters interleaved) is torch's too,
BACKWARD_POST included: a unit's post-backward frees its parameters and issues the next unit's
all-gather before its own reduce-scatter, as torch's ``_post_backward_hook``.
"""

import math

import pytest

import minifsdp
from minifsdp.fsdp.core.prefetch import ExecutionOrder
from tests import _workers_overlap as W
from tests._workers_fsdp import assert_same_training, pairs


@pytest.fixture(scope="module")
def runs():
    return minifsdp.spawn(W.prefetch_worker, world_size=2, timeout_s=240)


KEYS = [("FULL_SHARD", n) for n in W.PREFETCH_SETTINGS] + [("SHARD_GRAD_OP", "none"), ("SHARD_GRAD_OP", "fwd+pre")]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("key", KEYS)
def test_bitwise_vs_torch_fsdp1_same_prefetch(runs, key):
    for rank, res in enumerate(runs):
        assert_same_training(res[key]["ours"], res[key]["torch"], f"rank {rank} {key}")


def test_prefetch_never_changes_results(runs):
    for rank, res in enumerate(runs):
        base = res[("FULL_SHARD", "none")]["ours"]
        for name in ("pre", "post", "fwd+post,nolimit"):
            assert_same_training(res[("FULL_SHARD", name)]["ours"], base, f"rank {rank} {name} vs no prefetch")


@pytest.mark.parametrize("key", KEYS)
def test_all_gather_order_is_torch_fsdp1s(runs, key):
    """Oracle: torch FSDP1's all-gathers with the same setting, recorded in the same run; exact."""
    for res in runs:
        ours, theirs = res[key]["ours"], res[key]["torch"]
        assert ours["issued_ops"] == [u for u, _ in ours["issued"]]  # the tracer's events are the ops ours issued
        assert {u for u, _ in theirs["issued"]} == set(ours["units"])  # every torch all-gather named by its unit
        assert ours["issued"] == theirs["issued"]


@pytest.mark.parametrize("key", KEYS)
def test_collective_order_is_torch_fsdp1s(runs, key):
    """Oracle: torch FSDP1's c10d ops, recorded in the same run: all-gathers by unit, reduce-scatters by size."""
    for res in runs:
        assert res[key]["ours"]["collectives"] == res[key]["torch"]["collectives"]


def test_blocks_gathered_at_once(runs):
    """Non-root units gathered or on their way when an all-gather is issued: one without prefetching; two with
    (this model has two blocks, so limit_all_gathers, which on a CPU delays nothing, has nothing to bound)."""
    for res in runs:
        for name in ("pre", "post", "fwd+pre"):
            assert res[("FULL_SHARD", name)]["ours"]["max_alive"] <= 2
        assert res[("FULL_SHARD", "none")]["ours"]["max_alive"] == 1  # one block gathered at a time


def _spans(events, kind, unit):
    return sorted((e for e in events if e[0] == kind and e[1] == unit and e[3] is not None), key=lambda e: e[2])


def _instants(events, kind, unit):
    return sorted((e for e in events if e[0] == kind and e[1] == unit and e[3] is None), key=lambda e: e[2])


@pytest.mark.parametrize("setting", ["pre", "fwd+pre"])
def test_tracer_records_what_ran(runs, setting):
    """Our tracer on FULL_SHARD + BACKWARD_PRE (and forward_prefetch: a unit whose views its predecessor's prefetch
    made computes once its own forward has waited), 4 steps: every unit's compute, gathers and reductions, in time.

    Events are (kind, unit, start, end) in seconds, end None for an instant.
    """
    for res in runs:
        ours = res[("FULL_SHARD", setting)]["ours"]
        events, names = ours["events"], ours["units"]
        assert len(names) == len(set(names)) and "root" in names
        assert {e[1] for e in events} == set(names)  # every unit traced, nothing else
        issued_per_unit = {u: sum(1 for v, _ in ours["issued"] if v == u) for u in names}
        for u in names:
            fwd, bwd = _spans(events, "forward", u), _spans(events, "backward", u)
            assert len(fwd) == len(bwd) == W.STEPS  # one forward and one backward span per step
            for kind in ("forward", "backward", "all-gather wait", "reduce-scatter wait"):
                spans = _spans(events, kind, u)
                for a, b in zip(spans, spans[1:]):
                    assert a[2] <= a[3] <= b[2], (u, kind)  # one at a time per unit and kind
            # every all-gather is waited for once, after it was issued and before the unit's next one,
            # and its parameters are then used by a forward or backward span that starts after the wait
            issued, waits = _instants(events, "all-gather issued", u), _spans(events, "all-gather wait", u)
            assert len(issued) == issued_per_unit[u] > 0
            compute = sorted(fwd + bwd, key=lambda e: e[2])
            for k, (i, w) in enumerate(pairs(issued, waits)):
                nxt = issued[k + 1][2] if k + 1 < len(issued) else math.inf
                assert i[2] <= w[2] <= w[3] <= nxt, (u, k)
                assert any(w[3] <= c[2] < nxt for c in compute), (u, k)
            for c in compute:  # no compute while this unit's all-gather is in flight
                k = max(j for j, i in enumerate(issued) if i[2] <= c[2])
                assert waits[k][3] <= c[2], (u, c)
            # each backward issues one reduce-scatter after it, waited for before the next step's forward
            rs, rs_waits = _instants(events, "reduce-scatter issued", u), _spans(events, "reduce-scatter wait", u)
            assert len(rs) == len(rs_waits) == W.STEPS
            for k, (b, (i, w)) in enumerate(pairs(bwd, pairs(rs, rs_waits))):
                assert b[3] <= i[2] <= w[2], (u, k)
                if k + 1 < W.STEPS:
                    assert w[3] <= fwd[k + 1][2], (u, k)
        # nested units compute inside the root's spans
        for kind in ("forward", "backward"):
            outer = _spans(events, kind, "root")
            for u in names:
                if u != "root":
                    for s in _spans(events, kind, u):
                        assert any(o[2] <= s[2] and s[3] <= o[3] for o in outer), (kind, u)
        # exposed_seconds() is the sum of the wait spans
        assert set(ours["exposed"]) == {"all-gather", "reduce-scatter"}
        for c in ("all-gather", "reduce-scatter"):
            waits = [e[3] - e[2] for e in events if e[0] == f"{c} wait"]
            assert len(waits) == sum(1 for e in events if e[0] == f"{c} issued")
            assert math.isclose(ours["exposed"][c], sum(waits), rel_tol=1e-12)  # same floats, same order


def test_gantt_chrome_trace_and_profiler(runs):
    for res in runs:
        files = res["trace_files"]
        assert files["png_bytes"] > 1000
        assert files["kinds"] == ["all-gather issued", "all-gather wait", "backward", "forward",
                                  "reduce-scatter issued", "reduce-scatter wait"]
        assert files["profiler_has_ours"]  # our spans are record_function ranges
        assert files["profiler_has_gloo"]  # next to torch's own collective ops


class _U:
    """A stand-in unit: the order reads whether it is the root and whether it has parameters."""

    def __init__(self, name: str, is_root: bool = False, params: bool = True):
        self.name, self.is_root, self._handle = name, is_root, object() if params else None

    def __repr__(self):
        return self.name


def test_execution_order_unit():
    order = ExecutionOrder()
    root, a, b, c = _U("root", is_root=True, params=False), _U("a"), _U("b"), _U("c")
    for u in (root, a, b, c):
        order.record_pre_forward(u)
    assert order.pre_forward == [a, b, c]  # a unit without parameters is never a prefetch target
    assert order.next_in_forward(a) is None  # not before the first iteration has ended
    for u in (b, c, a):
        order.record_post_forward(u)
    assert order.next_in_backward(a) == c and order.next_in_backward(c) == b and order.next_in_backward(b) is None
    order.end_iteration()
    order.record_pre_forward(root)  # the next forward begins (the root's forward resets what began)
    order.record_pre_forward(_U("d"))  # the order is fixed after the first iteration
    assert order.pre_forward == [a, b, c] and order.next_in_forward(a) == b and order.next_in_forward(c) is None
    assert order.post_forward == []
    for u in (a, b):
        order.record_pre_forward(u)
    assert order.next_in_forward(a) is None  # a called again: b's forward began already (torch: no prefetch)
    order.record_pre_forward(root)
    assert order.next_in_forward(a) == b  # a new forward


def test_limit_all_gathers_is_torchs_free_event_queue():
    """The rate limiter itself against torch's (``_limiter_utils._FreeEventQueue``), the same frees and all-gathers
    fed to both: before an all-gather, the oldest free event is waited for once two are queued, never otherwise;
    on a CPU it is torch's own ``torch.cpu.Event``, whose wait returns at once (so the limit never delays here)."""
    import random

    import torch
    from torch.distributed.fsdp._limiter_utils import _FreeEventQueue

    from minifsdp.fsdp.core.prefetch import FreeEvents

    ours, theirs, recorded = FreeEvents(), _FreeEventQueue(), []
    waited_ours, waited_theirs = [], []
    rng = random.Random(0)
    for _ in range(200):
        if rng.random() < 0.5:  # a reshard that frees: both record an event
            ours.record_free(torch.device("cpu"))
            recorded.append(ours[-1])
            theirs.enqueue(ours[-1])
        else:  # an all-gather: which event (by position in recording order) each waits for, if any
            before = list(ours)
            ours.wait_before_all_gather()
            gone = [e for e in before if all(e is not f for f in ours)]
            waited_ours.append([recorded.index(e) for e in gone])
            event = theirs.dequeue_if_needed()
            waited_theirs.append([] if event is None else [recorded.index(event)])
    assert len(waited_ours) == len(waited_theirs) > 50 and any(waited_ours) and not all(waited_ours)
    assert waited_ours == waited_theirs
    assert all(type(e) is torch.cpu.Event for e in recorded)
