"""The latency-bandwidth (alpha-beta) model of a collective, fitted to measured times.

The simplest model of sending a message of ``b`` bytes is

    t(b) = alpha + beta * b

``alpha`` (seconds) is what every call pays whatever its size: Python and C++ calls, the
handshakes, thread wake-ups, the 2(N-1) ring steps' fixed costs.  ``beta`` (seconds per byte)
is the inverse of the bandwidth the collective reaches on large messages: ``1 / beta`` bytes
per second of message (the *algorithm* bandwidth; times 2(N-1)/N it is the bus bandwidth).
Small messages measure alpha, large ones beta; the size where both terms are equal,
``alpha / beta`` bytes, is where a message stops being latency-bound (the "half-power point").

We fit alpha and beta by least squares on *relative* errors: each point is weighted by
``1 / t``, so that a 1 KB message (tens of microseconds) counts as much as a 64 MB one
(hundreds of milliseconds).  An unweighted fit would be decided by the largest sizes alone
and could even give a negative alpha.  Two unknowns, so the normal equations are a 2x2
system solved in closed form (no numpy/scipy needed).

Note: alpha below zero is not physical; it means the points do not follow a straight line
(noise, or a change of protocol between sizes).  We report it as measured instead of hiding it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["AlphaBeta", "fit_alpha_beta"]


@dataclass(frozen=True)
class AlphaBeta:
    """``t(bytes) = alpha + beta * bytes``, fitted to ``points`` measurements."""

    alpha: float  # seconds per call
    beta: float  # seconds per byte
    points: int
    rms_relative_error: float  # sqrt(mean(((fit - t) / t)^2)): how well the line explains the points

    def predict(self, nbytes: float) -> float:
        return self.alpha + self.beta * nbytes

    @property
    def bandwidth(self) -> float:
        """Bytes per second of message at large sizes (1 / beta); inf if beta <= 0."""
        return 1.0 / self.beta if self.beta > 0 else math.inf

    @property
    def half_power_bytes(self) -> float:
        """The size where latency and bandwidth terms are equal: alpha / beta."""
        return self.alpha / self.beta if self.beta > 0 else math.inf

    def describe(self) -> str:
        return (f"alpha {self.alpha * 1e6:.1f} us, 1/beta {self.bandwidth / 1e9:.3f} GB/s, "
                f"half-power at {self.half_power_bytes / 1024:.0f} KB, rms rel. error {self.rms_relative_error:.0%}")


def fit_alpha_beta(sizes: list[float], seconds: list[float]) -> AlphaBeta:
    """Weighted least squares of ``seconds ~ alpha + beta * sizes`` with weights ``1 / seconds``.

    Minimizes sum(((alpha + beta * b_i) - t_i) / t_i)^2.  Needs at least two distinct sizes
    and positive times.
    """
    if len(sizes) != len(seconds):
        raise ValueError(f"fit_alpha_beta: {len(sizes)} sizes but {len(seconds)} times.")
    if len(set(sizes)) < 2:
        raise ValueError("fit_alpha_beta: needs at least two distinct message sizes.")
    if any(t <= 0 for t in seconds):
        raise ValueError("fit_alpha_beta: every time must be positive.")
    # Rows of the weighted system: [1/t, b/t] . [alpha, beta] = 1.
    s11 = sum(1 / t**2 for t in seconds)
    s12 = sum(b / t**2 for b, t in zip(sizes, seconds))
    s22 = sum(b * b / t**2 for b, t in zip(sizes, seconds))
    r1 = sum(1 / t for t in seconds)
    r2 = sum(b / t for b, t in zip(sizes, seconds))
    det = s11 * s22 - s12 * s12
    alpha = (r1 * s22 - r2 * s12) / det
    beta = (s11 * r2 - s12 * r1) / det
    rel = [((alpha + beta * b) - t) / t for b, t in zip(sizes, seconds)]
    return AlphaBeta(alpha, beta, len(sizes), math.sqrt(sum(e * e for e in rel) / len(rel)))
