"""The FSDP2 port's CI slice: a few cases of each ported file, run in one batch (one spawn of 2 ranks).

The default test collection runs this module only (see ``conftest.py``); ``python -m minifsdp torch-suite`` runs
every other module of the port instead and leaves this one out, so no case is counted twice.  Each case here is
the very case object of its home module, under the id ``<group>.<case id>``.
"""

import importlib

import pytest

from tests.torch_suite import _workers as W
from tests.torch_suite.fsdp2 import _side as S

PICK = {
    "training": ["train_parity_single_group:lin_shapes=7x15,15x3,largest_dim=False", "multi_forward_module:raf=2",
                 "partial_group_forward_then_standalone:raf=True,tie=False,mp=none,ac=False"],
    "comm": ["communication_count:raf=None", "backward_prefetch_forward_backward:raf=True,ckpt=utils",
             "backward_misprefetch"],
    "mixed_precision": ["reduce_dtype:reduce_dtype=float32,raf=True,placement_fn=False",
                        "structured_input_output:container=nested_dataclass,mp=bf16_fp32_reduce"],
    "clip_grad_norm": ["clip_grad_norm_1d:norm_type=2"],
    "grad_scaler": ["gradient_scaler:has_inf=True"],
    "state_dict": ["cached_state_dict:mlp_dim=3"],
    "frozen": ["train_mixed_requires_grad_per_group:raf=True,ac=True,freeze_after_init=False"],
    "autograd": ["nontensor_activations:container=dataclass"],
    "init": ["meta_device_1d_init"],
    "state": ["fully_shard_cls"],
    "extensions": ["train_parity:version=2,raf=True", "outer_size_stride"],
}
SECONDS_PER_CASE = 15.0

CASES = W.Cases()
for _group, _ids in PICK.items():
    _home = importlib.import_module(f"tests.torch_suite.fsdp2.test_{_group}").CASES
    for _cid in _ids:
        assert _home[_cid].world == 2, f"{_group}.{_cid}: the slice runs in one 2-rank spawn"
        CASES[f"{_group}.{_cid}"] = _home[_cid]


@pytest.mark.parametrize("cid", S.H.params(CASES, {}, tuple(CASES)))
def test_case(cid):
    S.check(__name__, cid)
