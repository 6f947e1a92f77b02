"""The scheduler's periodic status line: what runs and waits, KV use, throughput, and with
speculative decoding the drafts accepted per verification step."""

from __future__ import annotations

import logging
import time

from batonlm.ipc.messages import SchedulerStats

logger = logging.getLogger("batonlm.scheduler.scheduler")

STATUS_LOG_INTERVAL_S = 10.0


class StatusLog:
    def __init__(self) -> None:
        self._last = time.monotonic()
        self._tokens_at_last = 0

    def due(self) -> bool:
        return time.monotonic() - self._last >= STATUS_LOG_INTERVAL_S

    def log(self, stats: SchedulerStats) -> None:
        now = time.monotonic()
        elapsed, self._last = now - self._last, now
        spec = ""
        if stats.spec_verify_steps:
            spec = (f", {stats.spec_accepted_tokens / stats.spec_verify_steps:.2f} drafts accepted per verification "
                    f"({stats.spec_verify_steps} steps)")
        logger.info(
            "running %d, queued %d, KV %d/%d in use (%.0f%%), %d cached, %.1f tokens/s%s",
            stats.num_running, stats.num_waiting, stats.kv_used, stats.kv_capacity,
            100.0 * stats.kv_used / max(1, stats.kv_capacity), stats.kv_evictable,
            (stats.generated_tokens - self._tokens_at_last) / elapsed, spec,
        )
        self._tokens_at_last = stats.generated_tokens
