"""Poisson arrivals: the right mean gap for a seed, and `inf` sends everything at once."""

from __future__ import annotations

import math
import statistics

import pytest

from batonlm.bench.arrivals import arrival_offsets


@pytest.mark.parametrize("rate", [2.0, 40.0])
def test_poisson_gaps_have_the_right_mean(rate):
    offsets = arrival_offsets(20001, rate, seed=5)
    assert offsets[0] == 0.0
    gaps = [b - a for a, b in zip(offsets, offsets[1:], strict=False)]
    assert all(g >= 0 for g in gaps)
    mean = statistics.fmean(gaps)
    assert mean == pytest.approx(1 / rate, rel=0.03)
    # Exponential gaps: the standard deviation equals the mean, and about 1/e of them exceed it.
    assert statistics.pstdev(gaps) == pytest.approx(mean, rel=0.05)
    assert sum(g > mean for g in gaps) / len(gaps) == pytest.approx(math.exp(-1), abs=0.02)


def test_seeded_and_reproducible():
    assert arrival_offsets(50, 3.0, seed=1) == arrival_offsets(50, 3.0, seed=1)
    assert arrival_offsets(50, 3.0, seed=1) != arrival_offsets(50, 3.0, seed=2)


def test_inf_sends_all_at_once():
    assert arrival_offsets(7, math.inf) == [0.0] * 7


@pytest.mark.parametrize("rate", [0.0, -1.0, math.nan])
def test_bad_rate(rate):
    with pytest.raises(ValueError, match="rate"):
        arrival_offsets(3, rate)
