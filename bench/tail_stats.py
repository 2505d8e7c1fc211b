"""Percentiles over every request of every repeat, and whether two targets'
percentiles really differ (a bootstrap confidence interval of the difference).

One load's TTFT p99 is about its n/100-th slowest request: on this box it moves
2-8 ms between runs of the same target, more than the gap between two Serve
targets. Pooling the repeats' requests gives a p99 over several times as many,
and the interval says whether "ahead" is a difference or a draw.

The bootstrap takes requests as independent. At c=1 they nearly are; at c=32
with ``--range-ratio 0`` they come in rounds of 32 that start and end together
(one stall delays a whole round), so a p99 there is about the slowest round
and its interval is too narrow: draw lengths (``--range-ratio``) for c=32 tails.
"""

from __future__ import annotations

import numpy as np


def percentile_ms(samples_s: list[float], q: float) -> float:
    """The q-th percentile of latencies in seconds, in ms (numpy's linear
    interpolation, as ``vllm bench serve`` computes its own)."""
    return float(np.percentile(np.asarray(samples_s) * 1000, q))


def bootstrap_difference(
    a_s: list[float], b_s: list[float], q: float, iterations: int = 2000, seed: int = 0, level: float = 0.95
) -> tuple[float, float, float]:
    """The q-th percentile of ``a`` minus that of ``b`` (ms), with the bounds of
    its ``level`` bootstrap interval: each side resampled with replacement,
    independently (the two targets' requests are not paired)."""
    rng = np.random.default_rng(seed)
    a = np.asarray(a_s) * 1000
    b = np.asarray(b_s) * 1000
    resampled_a = np.percentile(a[rng.integers(0, len(a), (iterations, len(a)))], q, axis=1)
    resampled_b = np.percentile(b[rng.integers(0, len(b), (iterations, len(b)))], q, axis=1)
    tail = (1 - level) / 2 * 100
    low, high = np.percentile(resampled_a - resampled_b, [tail, 100 - tail])
    return float(np.percentile(a, q) - np.percentile(b, q)), float(low), float(high)


def verdict(low: float, high: float) -> str:
    """Lower is better for a latency: who leads, or a draw when the interval holds 0."""
    if high < 0:
        return "first ahead"
    if low > 0:
        return "second ahead"
    return "no difference"
