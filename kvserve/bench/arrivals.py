"""When each request is sent: a Poisson process (burstiness 1) or, generally, gamma-distributed
inter-arrival gaps with shape = burstiness and the same mean 1/rate (as `vllm bench serve`).
Burstiness < 1 clumps requests together, > 1 spaces them more evenly than Poisson."""

from __future__ import annotations

import math

import numpy as np


def arrival_offsets(num_requests: int, request_rate: float, burstiness: float = 1.0,
                    seed: int = 0) -> list[float]:
    """Seconds from the benchmark start at which request i is due.

    As `vllm bench serve` sends them: every request, the first included, after a gap, and the gaps' sum scaled
    so that the last request is due at exactly num_requests / rate. Unscaled, a run of a few hundred requests
    offered a rate off by up to ~10% from the one asked (seed 0, 200 requests at 4/s: 3.56/s), and its
    throughput with it, by the seed. Offsets are absolute (a cumulative sum), so time lost sleeping or
    scheduling never accumulates into a lower real rate than asked for."""
    if num_requests <= 0:
        return []
    if burstiness <= 0:
        raise ValueError("--burstiness must be > 0")
    if math.isinf(request_rate):
        return [0.0] * num_requests  # everything at once; --max-concurrency does the pacing
    if request_rate <= 0:
        raise ValueError("--request-rate must be > 0 (or inf)")
    rng = np.random.default_rng(seed)
    # Gamma(shape=k, scale=1/(rate*k)) has mean 1/rate for any k; k == 1 is the exponential.
    offsets = np.cumsum(rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=num_requests))
    return (offsets * (num_requests / request_rate / offsets[-1])).tolist()
