"""Port of torch's test_fully_shard_clip_grad_norm_.py: ``torch.nn.utils.clip_grad_norm_`` over sharded parameters.

torch's check, on a Transformer with one group per block (1-D mesh, 2 ranks), for norm types 2, 1 and inf, 10
iterations: every gradient's norm exceeds the max norm first (so clipping is not vacuous); torch's own
``clip_grad_norm_(model.parameters(), foreach=True)`` returns a DTensor whose whole equals the norm of the
replicated reference (one all-reduce per mesh dim to make it replicated); afterwards every gradient's norm is at
most the max norm and every non-zero gradient changed.  (The 2-D case shards with torch's tensor parallel: left out.)
Oracle: the replicated reference clipped by the same function.  Tolerance: torch's assertEqual.
"""

import functools

import pytest
import torch
from torch.distributed.tensor.debug import CommDebugMode
from torch.testing._internal.distributed._tensor.common_dtensor import ModelArgs, Transformer, TransformerBlock

from tests.torch_suite.fsdp2 import _side as S

SECONDS_PER_CASE = 15.0


def case_clip_grad_norm_1d(api, norm_type):
    torch.manual_seed(42)
    model = Transformer(ModelArgs(dropout_p=0.0))
    ref = S.replicated(model)
    ref_optim = torch.optim.Adam(ref.parameters(), lr=1e-2)
    for m in model.modules():
        if isinstance(m, TransformerBlock):
            api.fully_shard(m)
    api.fully_shard(model)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    max_norm, norm = 1, functools.partial(torch.linalg.vector_norm, ord=norm_type)
    torch.manual_seed(42 + torch.distributed.get_rank() + 1)
    inp = torch.randint(0, 8, (3, 16))
    for _ in range(10):
        ref_optim.zero_grad()
        ref(inp).sum().backward()
        optim.zero_grad()
        model(inp).sum().backward()
        ref_grads = [p.grad.detach().clone() for p in ref.parameters()]
        local_grads = [p.grad.to_local().detach().clone() for p in model.parameters()]
        for g, p in zip(ref_grads, model.parameters()):
            S.assert_equal(g, p.grad.full_tensor())
        assert all(norm(g).item() > max_norm for g in ref_grads)
        assert all(norm(g).item() > max_norm for g in local_grads)
        ref_total = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm=max_norm, norm_type=norm_type)
        with CommDebugMode() as comm:
            total = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=max_norm, norm_type=norm_type,
                                                   foreach=True)
        S.assert_equal(ref_total, total.full_tensor())
        got = comm.get_comm_counts()[torch.ops.c10d_functional.all_reduce]
        assert got == len(total.placements), f"{got} all-reduces, one per mesh dim expected"
        for p, g in zip(ref.parameters(), ref_grads):
            assert norm(p.grad).item() <= max_norm
            if torch.count_nonzero(g):
                assert not torch.equal(p.grad, g)
        for p, g in zip(model.parameters(), local_grads):
            assert norm(p.grad.to_local()).item() <= max_norm
            if torch.count_nonzero(g):
                assert not torch.equal(p.grad.to_local(), g)


CASES = S.Cases2()
for _nt in (2, 1, float("inf")):
    CASES.add(case_clip_grad_norm_1d, norm_type=_nt)
XFAIL: dict = {}
FAST = ("clip_grad_norm_1d:norm_type=2",)


@pytest.mark.parametrize("cid", S.H.params(CASES, XFAIL, FAST))
def test_case(cid):
    S.check(__name__, cid)

