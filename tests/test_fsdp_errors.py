"""Bad input to FSDP: each raises a clear error that names the problem and the fix, no hang.

One 2-rank spawn runs every case (``_workers_fsdp.errors_worker``); both ranks
must raise the same error (a rank that raised alone would leave the other
waiting in a collective: the spawn's timeout would turn that into a failure).
"""

import pytest

import minifsdp
from tests import _workers_fsdp as W


@pytest.fixture(scope="module")
def errors():
    return minifsdp.spawn(W.errors_worker, world_size=2, timeout_s=120)


def _err(errors, key):
    assert errors[0][key] == errors[1][key], "both ranks must raise the same error"
    assert errors[0][key] is not None, f"{key}: no error raised"
    return errors[0][key]


@pytest.mark.timeout(180)
def test_parameters_on_different_devices(errors):
    kind, msg = _err(errors, "devices")
    assert kind == "ValueError" and "different devices" in msg and "module.to(device)" in msg


def test_hybrid_world_size_does_not_split(errors):
    kind, msg = _err(errors, "hybrid_split")
    assert kind == "ValueError" and "does not split" in msg and "divides 2" in msg
    kind, msg = _err(errors, "hybrid_tile")
    assert kind == "ValueError" and "tile the world" in msg
    kind, msg = _err(errors, "hybrid_none")
    assert kind == "ValueError" and "device_mesh=" in msg and "(shard_group, replicate_group)" in msg


def test_model_differs_across_ranks(errors):
    kind, msg = _err(errors, "differs")
    assert kind == "RuntimeError" and "differs across ranks" in msg and "sync_module_states=True" in msg
    assert errors[0]["synced_equals_rank0"] and errors[1]["synced_equals_rank0"]


def test_frozen_and_trainable_in_one_flat_parameter(errors):
    kind, msg = _err(errors, "frozen_mix")
    assert kind == "ValueError" and "use_orig_params=True" in msg


def test_optimizer_built_before_wrapping(errors):
    kind, msg = _err(errors, "optimizer_before_wrap")
    assert kind == "RuntimeError" and "built before wrapping" in msg and "after wrapping" in msg


def test_forward_again_after_step_before_backward(errors):
    assert errors[0]["two_forwards_ok"] is None and errors[1]["two_forwards_ok"] is None
    kind, msg = _err(errors, "forward_again")
    assert kind == "RuntimeError" and "before the backward" in msg and "torch.no_grad()" in msg
