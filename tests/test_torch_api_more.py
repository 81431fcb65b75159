"""Issue 20's behaviours, part 2: torch FSDP1 user code that must behave as on torch (CPU, gloo).

Oracle: torch FSDP1 (``device_id=cpu``, gloo) running the same rank function
(``tests/_workers_torch_api_more.py``) on the same seed and data; bitwise in fp32 unless a test says
why not.  Comparisons check keys, lengths, dtypes and shapes first (``tests/test_torch_api.py``'s
``same``).  2 ranks (Linear(5, 13)'s weight and bias already straddle the shards there).
"""

import pytest
import torch

from minifsdp import spawn
from tests import _workers_torch_api_more as W
from tests.test_torch_api import same


def run(case, *args, world=2):
    results = spawn(W.both, (case, *args), world_size=world)
    assert len(results) == world
    for rank, r in enumerate(results):
        same(r["ours"], r["torch"], f"rank {rank}")
    return results


def test_freezing_after_wrapping_as_torch():
    """``p.requires_grad_(False)`` after wrapping (use_orig_params=True): grad None, the optimizer leaves
    it, a wholly frozen unit computes none; unfrozen again, it trains (torch FSDP1's behaviour)."""
    rs = run("freeze_after_wrap")
    grads = dict(rs[0]["ours"]["grads"][0])
    assert grads["_fsdp_wrapped_module.2._fsdp_wrapped_module.weight"] is None
    assert grads["_fsdp_wrapped_module.4.weight"] is None
    assert dict(rs[0]["ours"]["grads"][2])["_fsdp_wrapped_module.2._fsdp_wrapped_module.weight"] is not None
    assert isinstance(rs[0]["ours"]["full"][0][1], torch.Tensor)


@pytest.mark.parametrize("orig", [False, True])
@pytest.mark.parametrize("how", ["half", "to_float16", "double"])
def test_dtype_conversion_before_the_first_forward_trains_as_torch(orig, how):
    """``model.half()`` (``.to(torch.float16)``, ``.double()``) after wrapping, before the first forward:
    the flat parameters are converted and the step runs in that dtype, bitwise torch's."""
    rs = run("convert", orig, how, True)
    want = torch.float64 if how == "double" else torch.float16
    assert {d for _, d, _ in rs[0]["ours"]["params"]} == {want}
    assert rs[0]["ours"]["losses"][0].dtype == want


@pytest.mark.parametrize("orig", [False, True])
def test_dtype_conversion_after_the_first_forward_raises_as_torch(orig):
    """After the first forward torch FSDP1 refuses at the all-gather (ValueError, its gather buffer keeps
    the old dtype); ours raises the same type, naming the fix."""
    rs = spawn(W.both, ("convert", orig, "half", False), world_size=2)
    assert len(rs) == 2
    for r in rs:
        same(r["ours"]["params"], r["torch"]["params"])
        assert r["torch"]["error"] == r["ours"]["error"] == "ValueError"
        assert r["ours"]["names_fix"]
