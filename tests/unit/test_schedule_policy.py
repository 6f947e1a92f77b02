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


def test_priority_order_and_its_aging_bound():
    """Lower priority values first, arrival order among equals; a request that has waited
    aging_s seconds goes first (in arrival order among the aged), on the clock `now` gives."""
    reqs = []
    for rid, priority, arrived in (("a", 5, 0.0), ("b", 0, 1.0), ("c", 5, 2.0), ("d", -3, 3.0), ("e", 0, 4.0)):
        r = Request(rid, [1, 2], SamplingParams(), 0, 512, (2,), priority)
        r.arrived = arrived
        reqs.append(r)
    a, b, c, d, e = reqs
    order = admission_order(reqs, "priority", None, age_bound=10, aging_s=10.0, now=5.0)
    assert order == [d, b, e, a, c]
    # At 10.0, a has waited 10 s: it goes first; at 11.0 b too (after a: arrival order).
    assert admission_order(reqs, "priority", None, age_bound=10, aging_s=10.0, now=10.0) == [a, d, b, e, c]
    assert admission_order(reqs, "priority", None, age_bound=10, aging_s=10.0, now=11.0) == [a, b, d, e, c]
    assert admission_order(reqs, "priority", None, age_bound=10, aging_s=10.0, now=9.999) == order
