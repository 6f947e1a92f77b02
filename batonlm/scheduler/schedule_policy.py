"""In what order waiting requests are considered for admission.

* `fcfs`: arrival order (a retracted request goes back to the front).
* `lpm`: longest cached prefix first, so requests that share a prefix run while it is cached;
  a request that has waited `age_bound` iterations goes first regardless, so none starves.
  Matching costs a walk of the radix tree per request, so only the first `LPM_WINDOW` waiting
  requests are ordered this way (as in SGLang); the rest follow in arrival order.
"""

from __future__ import annotations

from collections.abc import Iterable

from batonlm.scheduler.radix_cache import RadixCache
from batonlm.scheduler.request import Request

POLICIES = ("fcfs", "lpm")
LPM_WINDOW = 128


def admission_order(
    waiting: Iterable[Request], policy: str, cache: RadixCache | None, age_bound: int
) -> list[Request]:
    queue = list(waiting)
    if policy == "fcfs" or cache is None or len(queue) < 2:
        return queue
    head, tail = queue[:LPM_WINDOW], queue[LPM_WINDOW:]
    aged = [r for r in head if r.waited >= age_bound]
    young = [r for r in head if r.waited < age_bound]
    # A stable sort: equal prefixes keep arrival order.
    young.sort(key=lambda r: -cache.match_len(r.fill_ids))
    return aged + young + tail
