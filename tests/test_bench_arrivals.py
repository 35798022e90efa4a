"""The arrival process: Poisson at burstiness 1, gamma otherwise, mean gap 1/rate."""

import numpy as np
import pytest

from kvserve.bench.arrivals import arrival_offsets


@pytest.mark.parametrize("rate", [0.5, 4.0, 50.0])
@pytest.mark.parametrize("burstiness", [0.25, 1.0, 4.0])
def test_mean_gap_is_one_over_rate_and_cv_follows_burstiness(rate, burstiness):
    offs = np.array(arrival_offsets(40_001, rate, burstiness, seed=1))
    gaps = np.diff(offs, prepend=0.0)
    assert offs[0] > 0.0 and np.all(gaps >= 0)   # as vLLM's: the first request waits a gap too
    assert gaps.mean() == pytest.approx(1.0 / rate, rel=0.03)
    # Gamma(shape=k): coefficient of variation 1/sqrt(k) -- 1 for Poisson, larger when bursty.
    assert gaps.std() / gaps.mean() == pytest.approx(1.0 / np.sqrt(burstiness), rel=0.05)


def test_poisson_gaps_are_exponential():
    gaps = np.diff(arrival_offsets(40_001, 2.0, 1.0, seed=3))
    # For an exponential, P(gap > mean) = e^-1.
    assert (gaps > 0.5).mean() == pytest.approx(np.exp(-1), abs=0.01)


@pytest.mark.parametrize("seed", range(5))
def test_the_last_request_is_due_at_n_over_rate_whatever_the_seed(seed):
    """As in vLLM's benchmark. The gaps' plain sum had offered a few hundred requests a rate up to ~10% off the
    one asked (seed 0, 200 requests at 4/s: the last sent at 56.2 s, 3.56/s), and the throughput moved with it."""
    offs = arrival_offsets(200, 4.0, 1.0, seed=seed)
    assert offs[-1] == pytest.approx(200 / 4.0, rel=1e-12)
    assert len(offs) == 200 and all(b >= a for a, b in zip(offs, offs[1:]))


def test_deterministic_by_seed():
    assert arrival_offsets(100, 3.0, 1.0, seed=7) == arrival_offsets(100, 3.0, 1.0, seed=7)
    assert arrival_offsets(100, 3.0, 1.0, seed=7) != arrival_offsets(100, 3.0, 1.0, seed=8)


def test_infinite_rate_sends_everything_at_once():
    assert arrival_offsets(5, float("inf")) == [0.0] * 5
    assert arrival_offsets(0, 1.0) == []


@pytest.mark.parametrize("rate, burstiness", [(0.0, 1.0), (-1.0, 1.0), (1.0, 0.0)])
def test_rejects_bad_parameters(rate, burstiness):
    with pytest.raises(ValueError):
        arrival_offsets(3, rate, burstiness)
