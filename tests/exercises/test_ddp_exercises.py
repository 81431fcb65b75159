"""Grades task 1.1 (DDP bucketing): the module ``impl_module("ddp_bucketing", impl)`` gives (the stub, or the
instructor's answer: minifsdp's own bucketing).  Oracle: buckets worked out by hand, and the rule itself on TinyGPT."""

import pytest
import torch

from minifsdp.models import TinyGPT
from tests.exercises import impl_module


@pytest.fixture
def assign_buckets(impl):
    return impl_module("ddp_bucketing", impl).assign_buckets


def _f32(*numels):
    return [torch.empty(n) for n in numels]


@pytest.mark.parametrize(
    "numels, cap, expected",
    [
        ((100,) * 5, 800, [[4, 3], [2, 1], [0]]),
        ((100,) * 5, 801, [[4, 3, 2], [1, 0]]),
        ((100,) * 5, 1, [[4], [3], [2], [1], [0]]),
        ((100,) * 5, 10**9, [[4, 3, 2, 1, 0]]),
        ((10, 1000, 10), 100, [[2, 1], [0]]),
        ((1000, 10, 10), 100, [[2, 1, 0]]),
    ],
)
def test_task1_1_examples(assign_buckets, numels, cap, expected):
    assert assign_buckets(_f32(*numels), cap) == expected


def test_task1_1_real_model_every_param_once_in_reverse(assign_buckets):
    params = list(TinyGPT(seed=0).parameters())
    cap = 2**14
    buckets = assign_buckets(params, cap)
    flat = [i for b in buckets for i in b]
    assert flat == list(reversed(range(len(params)))), "every index once, last parameter first"
    nbytes = [p.numel() * p.element_size() for p in params]
    for b in buckets[:-1]:
        assert sum(nbytes[i] for i in b) >= cap, f"bucket {b} was closed before reaching the cap"
        assert sum(nbytes[i] for i in b[:-1]) < cap, f"bucket {b} should have been closed one parameter earlier"
