"""Issue 20's behaviours, part 2: torch FSDP1 user code that must behave as on torch (CPU, gloo).

Oracle: torch FSDP1 (``device_id=cpu``, gloo) running the same rank function
(``tests/_workers_torch_api_more.py``) on the same seed and data; bitwise in fp32 unless a test says
why not.  Comparisons check keys, lengths, dtypes and shapes first (``tests/test_torch_api.py``'s
``same``).  2 ranks (Linear(5, 13)'s weight and bias already straddle the shards there).
"""

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
