"""The benchmark's pooled-tail statistics (bench/tail_stats.py): a difference is
called only when its bootstrap interval excludes zero."""

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from tail_stats import bootstrap_difference, percentile_ms, verdict  # noqa: E402


def latencies(seed: int, n: int, shift_s: float = 0.0) -> list[float]:
    """A long-tailed TTFT sample (s): 10 ms median, lognormal."""
    return list(np.random.default_rng(seed).lognormal(np.log(0.010), 0.4, n) + shift_s)


def test_percentile_is_in_ms_with_numpys_interpolation():
    assert percentile_ms([0.001, 0.002, 0.003, 0.004], 50) == 2.5
    assert percentile_ms([0.010] * 99 + [0.110], 99) == pytest.approx(11.0)


def test_two_draws_of_one_distribution_are_a_draw():
    difference, low, high = bootstrap_difference(latencies(1, 3000), latencies(2, 3000), 99)
    assert low < difference < high
    assert low < 0 < high
    assert verdict(low, high) == "no difference"


def test_a_tail_5_ms_shorter_is_called_ahead_and_the_sign_says_who():
    slow, fast = latencies(1, 3000, 0.005), latencies(2, 3000)
    difference, low, high = bootstrap_difference(fast, slow, 99)
    assert high < 0 and verdict(low, high) == "first ahead"
    reverse, low, high = bootstrap_difference(slow, fast, 99)
    assert reverse == -difference and low > 0 and verdict(low, high) == "second ahead"


def test_the_interval_is_reproducible_and_narrows_with_more_requests():
    a, b = latencies(3, 4000), latencies(4, 4000)
    assert bootstrap_difference(a, b, 99) == bootstrap_difference(a, b, 99)
    _, low_small, high_small = bootstrap_difference(a[:500], b[:500], 99)
    _, low_large, high_large = bootstrap_difference(a, b, 99)
    assert high_large - low_large < high_small - low_small
