"""Grades tasks 2.5 and 4.1a-b: ``exercises/overlap_tasks.py`` (``--impl=student``) or the instructor's answer,
run in the learner's process.  No ranks.

Oracles: 2.5 the execution orders our FSDP records on TinyGPT (tests/test_prefetch.py checks the
resulting all-gather order and bitwise results against torch FSDP1); 4.1a torch's rule
(``_init_param_reduce_dtypes`` in torch/distributed/fsdp/_flat_param.py); 4.1b torch FSDP1's own steps,
bitwise: its cast of the gradient to ``reduce_dtype`` (post-backward), its zero padding, its pre-divide
factor (``DefaultState._get_gradient_predivide_factor``) and ``_div_if_needed`` before and after the sum
(``_reduce_grad``), the sum in rank order (gloo's at 2 ranks; one process here), the cast to the
parameter's dtype (``_cast_grad_to_param_dtype``), on gradients drawn from the grading seed; plus cases that
need no oracle: the fp16 overflow that the pre-division avoids, output dtype and shape, and the exact average
of small integers.
"""

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.algorithms._comm_hooks.default_hooks import DefaultState
from torch.distributed.fsdp._runtime_utils import _div_if_needed


def _fn(learner, name):
    return getattr(learner("overlap_tasks"), name)


def _torch_fsdp1_reduction(rank_grads, rank, reduce_dtype, param_dtype=torch.float32):
    """What torch FSDP1 leaves in rank ``rank``'s sharded gradient, each of its steps by its own helpers."""
    n, numel = len(rank_grads), rank_grads[0].numel()
    pre = DefaultState._get_gradient_predivide_factor(n)
    chunk = -(-numel // n)
    total = None
    for g in rank_grads:
        g = F.pad(g.to(reduce_dtype), [0, chunk * n - numel]).clone()  # a copy: the inputs stay as they are
        _div_if_needed(g, pre)
        total = g if total is None else total + g
    shard = total[rank * chunk:(rank + 1) * chunk].clone()
    _div_if_needed(shard, n / pre)
    return shard.to(param_dtype)


def test_task2_5_prefetch_target(learner):
    f = _fn(learner, "prefetch_target")
    pre, post = ["root", "blocks.0", "blocks.1"], ["blocks.0", "blocks.1", "root"]
    assert f(pre, post, "root", "forward") == "blocks.0"
    assert f(pre, post, "blocks.0", "forward") == "blocks.1"
    assert f(pre, post, "blocks.1", "forward") is None
    assert f(pre, post, "root", "backward") == "blocks.1"
    assert f(pre, post, "blocks.1", "backward") == "blocks.0"
    assert f(pre, post, "blocks.0", "backward") is None
    assert f(pre, post, "lm_head", "backward") is None
    assert f(pre, [], "root", "backward") is None  # nothing recorded this iteration yet
    with pytest.raises(ValueError):
        f(pre, post, "root", "sideways")


def test_task4_1a_mixed_precision_dtypes(learner):
    f = _fn(learner, "mixed_precision_dtypes")
    bf, h, f32 = torch.bfloat16, torch.float16, torch.float32
    assert f(None, None, f32) == (f32, f32)
    assert f(bf, None, f32) == (bf, bf)  # the twist: reduce in param_dtype
    assert f(bf, f32, f32) == (bf, f32)
    assert f(None, h, f32) == (f32, h)
    assert f(h, bf, f32) == (h, bf)


def _grads(n, numel, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(numel, generator=g) * 10 ** torch.randint(-3, 3, (numel,), generator=g)).to(dtype)
            for _ in range(n)]


def test_task4_1b_reduce_gradient_shard(learner, course_seed):
    f = _fn(learner, "reduce_gradient_shard")
    # exact case: small integers, the average is exact in every dtype
    grads = [torch.tensor([2.0, 4.0, 6.0, 8.0, 10.0]) * (r + 1) for r in range(2)]
    out0 = f([g.to(torch.bfloat16) for g in grads], 0, torch.bfloat16)
    assert out0.dtype == torch.float32 and out0.shape == (3,)
    assert out0.tolist() == [3.0, 6.0, 9.0]
    assert f([g.to(torch.bfloat16) for g in grads], 1, torch.bfloat16).tolist() == [12.0, 15.0, 0.0]  # padding
    # fp16: 40000 + 40000 overflows, (40000 / 2) + (40000 / 2) does not
    big = [torch.full((4,), 40000.0, dtype=torch.float16) for _ in range(2)]
    before = [b.clone() for b in big]
    out = f(big, 0, torch.float16)
    assert torch.isfinite(out).all() and out.tolist() == [40000.0, 40000.0]
    assert all(torch.equal(a, b) for a, b in zip(big, before)), "rank_grads were modified"
    # bitwise against torch FSDP1's steps, bf16 and fp16, N = 2, 3, 4, reduce in low precision and in fp32
    for n in (2, 3, 4):
        for dtype in (torch.bfloat16, torch.float16):
            for reduce_dtype in (dtype, torch.float32):
                grads = _grads(n, 11, dtype, seed=1000 * course_seed + n)
                for rank in range(n):
                    got, want = f(grads, rank, reduce_dtype), _torch_fsdp1_reduction(grads, rank, reduce_dtype)
                    assert got.dtype == want.dtype and torch.equal(got, want), (n, dtype, reduce_dtype, rank)
