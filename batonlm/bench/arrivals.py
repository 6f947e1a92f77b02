"""Request arrival times: a Poisson process with a given mean rate, or all at once."""

from __future__ import annotations

import math
import random


def arrival_offsets(n: int, rate: float, seed: int = 0) -> list[float]:
    """Send times in seconds from the start for `n` requests at `rate` requests/s.

    The first request goes at 0; the gaps are exponential with mean 1 / rate (a Poisson
    process). An infinite rate sends every request at 0."""
    if not rate > 0:
        raise ValueError(f"request rate must be positive, got {rate}")
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(f"arrivals-{seed}")  # independent of the dataset's stream for the same seed
    t, out = 0.0, []
    for i in range(n):
        if i:
            t += rng.expovariate(rate)
        out.append(t)
    return out
