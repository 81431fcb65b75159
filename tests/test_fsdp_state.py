"""A unit's life as enums (fsdp/core/state.py): the states it passes through in a real step on 2 ranks.

Oracle: the state machine drawn in ``minifsdp/fsdp/core/state.py`` (no torch counterpart to compare with:
torch FSDP1 keeps these as private flags).  Units: root (net.4 and the glue), net.0, net.2.
"""

import pytest

from minifsdp import spawn
from tests import _workers_state

ALL_UNITS = ("root", "net.0", "net.2")


@pytest.fixture(scope="module")
def trace():
    return spawn(_workers_state.state_trace_worker, world_size=2)[0]


def _expect(states, training, handle=None, units=ALL_UNITS):
    for u in units:
        assert states[u][0] == training, (u, states[u])
        if handle is not None:
            assert states[u][1] == handle, (u, states[u])


def test_idle_and_sharded_between_steps(trace):
    assert sorted(trace["after_wrap"]) == sorted(ALL_UNITS)
    _expect(trace["after_wrap"], "IDLE", "SHARDED")
    _expect(trace["after_no_grad_forward"], "IDLE")  # no backward will come: nothing awaits it


def test_inside_a_forward_the_unit_and_its_root_are_in_forward(trace):
    s = trace["inside_net2_forward"]
    assert s["root"] == ("FORWARD", "UNSHARDED") and s["net.2"] == ("FORWARD", "UNSHARDED")
    assert s["net.0"] == ("AWAITING_BACKWARD", "SHARDED")  # ran before, freed after its forward


def test_after_forward_every_unit_awaits_its_backward(trace):
    s = trace["after_forward"]
    _expect(s, "AWAITING_BACKWARD")
    assert s["root"][1] == "UNSHARDED" and s["net.0"][1] == s["net.2"][1] == "SHARDED"  # the root keeps its own


def test_summon_between_forward_and_backward(trace):
    _expect(trace["inside_summon"], "SUMMON_FULL_PARAMS", "UNSHARDED")
    assert trace["after_summon"] == trace["after_forward"]  # put back as it was (the root stays gathered)


def test_backward_walks_the_units_in_reverse(trace):
    order = [name for name, _ in trace["at_each_reduce"]]
    assert order == ["net.2", "net.0", "root"]
    first = trace["at_each_reduce"][0][1]
    # torch FSDP1's _post_backward_hook frees the unsharded parameters before it reduce-scatters the
    # gradient (the gradient is a tensor of its own), and ours follows that order: SHARDED already
    assert first["net.2"] == ("POST_BACKWARD", "SHARDED")
    # BACKWARD_PRE (the default) issued net.0's all-gather in net.2's pre-backward; nobody waited on it yet
    assert first["root"][0] == "PRE_BACKWARD" and first["net.0"] == ("AWAITING_BACKWARD", "GATHERING")
    second = trace["at_each_reduce"][1][1]
    assert second["net.2"] == ("POST_BACKWARD", "SHARDED") and second["net.0"][0] == "POST_BACKWARD"


def test_back_to_idle_and_sharded_after_backward(trace):
    _expect(trace["after_backward"], "IDLE", "SHARDED")
