"""Admission order: fcfs keeps arrival order; lpm puts the longest cached prefix first, but a
request that waited past the age bound goes first whatever its prefix."""

from batonlm.config import SCHEDULE_POLICIES
from batonlm.sampling_params import SamplingParams
from batonlm.scheduler.radix_cache import RadixCache
from batonlm.scheduler.request import Request
from batonlm.scheduler.schedule_policy import POLICIES, admission_order


def req(rid, prompt, waited=0):
    r = Request(rid, prompt, SamplingParams(), 0, 512, (2,))
    r.waited = waited
    return r


def test_the_config_offers_the_policies():
    assert SCHEDULE_POLICIES == POLICIES


def test_fcfs_and_lpm_orders():
    cache = RadixCache(lambda slots: None)
    cache.insert([1, 2, 3, 4, 5, 6], list(range(10, 16)))
    cache.insert([1, 7, 8], [20, 21, 22])
    a, b, c, d = req("a", [9, 9]), req("b", [1, 2, 3, 4, 9]), req("c", [1, 7, 9]), req("d", [1, 2, 3, 4, 5, 6, 7])
    queue = [a, b, c, d]
    assert admission_order(queue, "fcfs", cache, age_bound=10) == [a, b, c, d]
    assert admission_order(queue, "lpm", cache, age_bound=10) == [d, b, c, a]
    assert admission_order(queue, "lpm", None, age_bound=10) == [a, b, c, d]  # no cache: arrival order
    a.waited = 10  # waited long enough: first, whatever its prefix
    assert admission_order(queue, "lpm", cache, age_bound=10) == [a, d, b, c]
