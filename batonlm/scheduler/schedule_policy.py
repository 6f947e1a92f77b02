"""In what order waiting requests are considered for admission.

* `fcfs`: arrival order (a retracted request goes back to the front).
* `lpm`: longest cached prefix first, so requests that share a prefix run while it is cached;
  a request that has waited `age_bound` iterations goes first regardless, so none starves.
  Matching costs a walk of the radix tree per request, so only the first `LPM_WINDOW` waiting
  requests are ordered this way (as in SGLang); the rest follow in arrival order.
* `priority`: the requests' `priority`, lower values first (vLLM's convention), then arrival
  order (a retracted request first among its equals); a request that has waited `aging_s`
  seconds goes first regardless, so none starves. The planner also retracts the lowest
  priority first, and with preemption on retracts lower ones for a waiting higher one.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from batonlm.scheduler.radix_cache import RadixCache
from batonlm.scheduler.request import Request

POLICIES = ("fcfs", "lpm", "priority")
LPM_WINDOW = 128


def admission_order(
    waiting: Iterable[Request], policy: str, cache: RadixCache | None, age_bound: int, aging_s: float = 60.0,
    now: float | None = None,
) -> list[Request]:
    """`now`: time.monotonic()'s clock (the priority policy's ages)."""
    queue = list(waiting)
    if policy == "priority":
        now = time.monotonic() if now is None else now
        aged = [r for r in queue if now - r.arrived >= aging_s]
        young = sorted((r for r in queue if now - r.arrived < aging_s), key=lambda r: r.priority)  # stable
        return aged + young
    if policy == "fcfs" or cache is None or len(queue) < 2:
        return queue
    head, tail = queue[:LPM_WINDOW], queue[LPM_WINDOW:]
    aged = [r for r in head if r.waited >= age_bound]
    young = [r for r in head if r.waited < age_bound]
    # A stable sort: equal prefixes keep arrival order.
    young.sort(key=lambda r: -cache.match_len(r.cache_key(r.fill_ids)))
    return aged + young + tail
