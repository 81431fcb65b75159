"""The alpha-beta fit of ``bench collectives`` (minifsdp/bench/fit.py), on synthetic data: no timing."""

import math
import random

import pytest

from minifsdp.bench.fit import fit_alpha_beta

SIZES = [1024 * 4**k for k in range(10)]  # 1 KB .. 256 MB, like the bench


def test_recovers_alpha_and_beta_exactly_from_a_line():
    alpha, beta = 50e-6, 1 / 2e9  # 50 us, 2 GB/s
    fit = fit_alpha_beta(SIZES, [alpha + beta * b for b in SIZES])
    assert fit.alpha == pytest.approx(alpha, rel=1e-9)
    assert fit.beta == pytest.approx(beta, rel=1e-9)
    assert fit.bandwidth == pytest.approx(2e9, rel=1e-9)
    assert fit.half_power_bytes == pytest.approx(alpha / beta, rel=1e-9)
    assert fit.rms_relative_error < 1e-9


def test_relative_weighting_keeps_alpha_from_the_small_sizes():
    """5% multiplicative noise: alpha still within 10% (an unweighted fit is dominated by the big sizes)."""
    rng = random.Random(0)
    alpha, beta = 200e-6, 1 / 1e9
    times = [(alpha + beta * b) * (1 + rng.uniform(-0.05, 0.05)) for b in SIZES]
    fit = fit_alpha_beta(SIZES, times)
    assert fit.alpha == pytest.approx(alpha, rel=0.1)
    assert fit.beta == pytest.approx(beta, rel=0.05)
    assert 0 < fit.rms_relative_error < 0.05
    # the same data fitted without weights: alpha is off by far more than 10% (why we weight)
    n = len(SIZES)
    mb, mt = sum(SIZES) / n, sum(times) / n
    slope = sum((b - mb) * (t - mt) for b, t in zip(SIZES, times)) / sum((b - mb) ** 2 for b in SIZES)
    assert abs((mt - slope * mb) - alpha) > 0.1 * alpha


def test_not_a_line_shows_in_the_error():
    times = [1e-4 * math.sqrt(b) for b in SIZES]  # no alpha + beta * b fits this
    assert fit_alpha_beta(SIZES, times).rms_relative_error > 0.2


@pytest.mark.parametrize("sizes,times,match", [([1, 2], [1.0], "2 sizes but 1"), ([4, 4], [1.0, 2.0], "distinct"),
                                               ([1, 2], [1.0, 0.0], "positive")])
def test_bad_input(sizes, times, match):
    with pytest.raises(ValueError, match=match):
        fit_alpha_beta(sizes, times)
