"""The scheduler's periodic status line: what runs and waits, KV use, throughput, and with
speculative decoding the drafts accepted per verification step."""

from __future__ import annotations

import logging
import time

logger = logging.getLogger("batonlm.scheduler.scheduler")

STATUS_LOG_INTERVAL_S = 10.0


class StatusLog:
    def __init__(self) -> None:
        self._last = time.monotonic()
        self._tokens_at_last = 0

    def maybe_log(self, sched) -> None:
        now = time.monotonic()
        if now - self._last < STATUS_LOG_INTERVAL_S or sched.is_idle:
            return
        elapsed, self._last = now - self._last, now
        mem = sched.memory
        spec = ""
        if sched.speculator is not None and sched.speculator.stats.steps:
            st = sched.speculator.stats
            spec = f", {st.accepted / st.steps:.2f} drafts accepted per verification ({st.steps} steps)"
        logger.info(
            "running %d, queued %d, KV %d/%d in use (%.0f%%), %d cached, %.1f tokens/s%s",
            len(sched.running), len(sched.waiting), mem.in_use, mem.capacity,
            100.0 * mem.in_use / max(1, mem.capacity), mem.evictable,
            (sched.generated_tokens - self._tokens_at_last) / elapsed, spec,
        )
        self._tokens_at_last = sched.generated_tokens
