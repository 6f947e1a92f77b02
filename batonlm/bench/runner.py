"""The load loop: warm up, dispatch requests on their arrival schedule, cap concurrency, gather."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import httpx

from batonlm.bench.arrivals import arrival_offsets
from batonlm.bench.client import RequestResult, Target, send_request
from batonlm.bench.datasets import BenchRequest

logger = logging.getLogger(__name__)


@dataclass
class RunResult:
    results: list[RequestResult]
    duration_s: float
    peak_concurrency: int


class InFlight:
    """Counts requests on the wire and remembers the most at once."""

    def __init__(self) -> None:
        self.now = 0
        self.peak = 0

    @contextlib.contextmanager
    def track(self):
        self.now += 1
        self.peak = max(self.peak, self.now)
        try:
            yield
        finally:
            self.now -= 1


def make_client(max_concurrency: int | None, timeout: float) -> httpx.AsyncClient:
    # httpx pools 100 connections by default; a larger burst would queue inside the client and
    # count as server latency, so the pool is as large as the concurrency allowed.
    limits = httpx.Limits(max_connections=max_concurrency, max_keepalive_connections=max_concurrency)
    return httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(timeout))


async def run_load(
    client: httpx.AsyncClient,
    target: Target,
    requests: Sequence[BenchRequest],
    request_rate: float,
    max_concurrency: int | None = None,
    seed: int = 0,
    warmup_requests: int = 0,
    progress: bool = True,
) -> RunResult:
    """Run the benchmark; warmup requests go first, all at once, and are not counted."""
    from tqdm.auto import tqdm

    semaphore = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    inflight = InFlight()

    async def one(req: BenchRequest, t0: float, scheduled_s: float, bar: tqdm | None) -> RequestResult:
        async with semaphore if semaphore else contextlib.nullcontext():
            with inflight.track():
                result = await send_request(client, target, req, t0, scheduled_s)
        if bar is not None:
            bar.update(1)
        return result

    if warmup_requests and requests:
        logger.info("sending %d warmup request(s)", warmup_requests)
        t0 = time.perf_counter()
        warm = [requests[i % len(requests)] for i in range(warmup_requests)]
        for r in await asyncio.gather(*(one(req, t0, 0.0, None) for req in warm)):
            if not r.success:
                logger.warning("warmup request failed: %s", r.error)
        inflight.peak = 0

    offsets = arrival_offsets(len(requests), request_rate, seed)
    logger.info("sending %d requests at %s requests/s, max concurrency %s",
                len(requests), request_rate, max_concurrency or "unlimited")
    bar = tqdm(total=len(requests), disable=not progress, desc="requests", unit="req")
    t0 = time.perf_counter()
    tasks = []
    try:
        for req, at in zip(requests, offsets, strict=True):
            delay = t0 + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(req, t0, at, bar)))
        results = list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()
        bar.close()
    duration = time.perf_counter() - t0
    return RunResult(results, duration, inflight.peak)
