"""Grades task 1.1 (DDP bucketing): ``exercises/ddp_bucketing.py`` (or the instructor's answer: minifsdp's own
bucketing), run in the learner's process.  Oracle: buckets worked out by hand, and the rule itself on TinyGPT's
parameters and on sizes drawn from the grading seed."""

import random

import pytest
import torch

from minifsdp.models import TinyGPT


@pytest.fixture
def assign_buckets(learner):
    return learner("ddp_bucketing").assign_buckets


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


def test_task1_1_real_model_every_param_once_in_reverse(assign_buckets, course_seed):
    rng = random.Random(f"{course_seed}:1.1")
    drawn = [torch.empty(rng.randint(1, 3000)) for _ in range(12)]  # one dtype: one bucket sequence
    for params, cap in ((list(TinyGPT(seed=0).parameters()), 2**14), (drawn, rng.randint(500, 8000))):
        buckets = assign_buckets(params, cap)
        flat = [i for b in buckets for i in b]
        assert flat == list(reversed(range(len(params)))), f"cap {cap}: every index once, last parameter first"
        nbytes = [p.numel() * p.element_size() for p in params]
        for b in buckets[:-1]:
            assert sum(nbytes[i] for i in b) >= cap, f"cap {cap}: bucket {b} was closed before reaching the cap"
            assert sum(nbytes[i] for i in b[:-1]) < cap, \
                f"cap {cap}: bucket {b} should have been closed one parameter earlier"
