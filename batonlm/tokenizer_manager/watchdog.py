"""The watchdog: liveness that means progress.

A scheduler with requests finishes iterations and sends what they produced (or, busy without
output, a heartbeat every second: scheduler.HEARTBEAT_S). One that sends nothing for
`--watchdog-timeout` while it has requests is stuck: it, its device worker or a tensor-parallel
rank is stopped (SIGSTOP) or hung, and /health would answer 200 while no client gets anything.
Then every request in flight ends with an error, the schedulers are killed (their device
workers die with them: PR_SET_PDEATHSIG), /health answers 503 and the server exits 1.

A frontend that was itself stalled (the loop woke late) gives the schedulers a fresh window:
their outputs are waiting unread, the stall was not theirs.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence

logger = logging.getLogger("batonlm.tokenizer_manager.manager")


class Watchdog:
    def __init__(self, timeout_s: float, in_flight: Sequence[int], last_heard: list[float],
                 on_stuck: Callable[[int, float], None]) -> None:
        """`in_flight` and `last_heard`: per replica, its requests and when it last sent (both
        kept up to date by their owners); `on_stuck(replica, quiet_s)` is called once."""
        self.timeout_s = timeout_s
        self.in_flight = in_flight
        self.last_heard = last_heard
        self.on_stuck = on_stuck
        self.tick_s = min(1.0, timeout_s / 4)
        self._busy_since: list[float | None] = [None] * len(last_heard)

    async def run(self) -> None:
        expected = time.monotonic() + self.tick_s
        while True:
            await asyncio.sleep(max(0.0, expected - time.monotonic()))
            now = time.monotonic()
            if now - expected > self.tick_s:  # this loop was stalled: nobody read the outputs
                self.last_heard[:] = [now] * len(self.last_heard)
            expected = now + self.tick_s
            stuck = self.check(now)
            if stuck is not None:
                self.on_stuck(*stuck)
                return

    def check(self, now: float) -> tuple[int, float] | None:
        """(replica, seconds quiet) of a stuck replica, if one is."""
        for r, busy in enumerate(self.in_flight):
            if not busy:
                self._busy_since[r] = None
                continue
            if self._busy_since[r] is None:
                self._busy_since[r] = now
            quiet = now - max(self._busy_since[r] or now, self.last_heard[r])
            if quiet > self.timeout_s:
                return r, quiet
        return None
