"""Summary metrics from per-request client-side timings.

Per successful request: TTFT is the time to the first non-empty content chunk; ITL the gaps
between consecutive content chunks (pooled over all requests); TPOT is
(e2e - ttft) / (output_tokens - 1) for requests with more than one output token; E2E runs to
`data: [DONE]`. Failed requests count only in `failed` and `errors`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

from batonlm.bench.client import RequestResult

PERCENTILES = (("median", 50.0), ("p90", 90.0), ("p99", 99.0))
LATENCY_METRICS = ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms")
STAT_KEYS = ("mean", *(name for name, _ in PERCENTILES))


def percentile(values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    xs = sorted(values)
    rank = q / 100.0 * (len(xs) - 1)
    lo = int(rank)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (rank - lo)


def stats(values: Sequence[float]) -> dict[str, float | None]:
    """mean, median, p90, p99; None for each when there are no values."""
    if not values:
        return dict.fromkeys(STAT_KEYS)
    out: dict[str, float | None] = {"mean": sum(values) / len(values)}
    for name, q in PERCENTILES:
        out[name] = percentile(values, q)
    return out


def itl_s(r: RequestResult) -> list[float]:
    t = r.chunk_times_s
    return [b - a for a, b in zip(t, t[1:], strict=False)]


def tpot_s(r: RequestResult) -> float | None:
    if not r.success or r.e2e_s is None or r.ttft_s is None or r.output_tokens < 2:
        return None
    return (r.e2e_s - r.ttft_s) / (r.output_tokens - 1)


def summarize(results: Sequence[RequestResult], duration_s: float, peak_concurrency: int) -> dict[str, Any]:
    """The summary block of the report (see `batonlm.bench.report` for the schema)."""
    ok = [r for r in results if r.success]
    failed = [r for r in results if not r.success]
    input_tokens = sum(r.prompt_len for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    per_s = (lambda x: x / duration_s) if duration_s > 0 else (lambda x: 0.0)
    ttft = [r.ttft_s * 1000 for r in ok if r.ttft_s is not None]
    tpot = [t * 1000 for r in ok if (t := tpot_s(r)) is not None]
    itl = [gap * 1000 for r in ok for gap in itl_s(r)]
    e2e = [r.e2e_s * 1000 for r in ok if r.e2e_s is not None]
    return {
        "completed": len(ok),
        "failed": len(failed),
        "errors": dict(Counter(r.error or "unknown" for r in failed).most_common()),
        "duration_s": duration_s,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": per_s(len(ok)),
        "input_throughput": per_s(input_tokens),
        "output_throughput": per_s(output_tokens),
        "total_token_throughput": per_s(input_tokens + output_tokens),
        "peak_concurrency": peak_concurrency,
        "ttft_ms": stats(ttft),
        "tpot_ms": stats(tpot),
        "itl_ms": stats(itl),
        "e2e_ms": stats(e2e),
    }


def output_tokens_over_time(results: Sequence[RequestResult], bin_s: float = 1.0) -> list[tuple[float, float]]:
    """(bin start in s, output tokens/s) across the run, spreading each request's output tokens
    evenly over its content chunks."""
    events: list[tuple[float, float]] = []
    for r in results:
        if r.success and r.chunk_times_s:
            per_chunk = r.output_tokens / len(r.chunk_times_s)
            events.extend((r.start_s + t, per_chunk) for t in r.chunk_times_s)
    if not events:
        return []
    bins = [0.0] * (int(max(t for t, _ in events) / bin_s) + 1)
    for t, n in events:
        bins[int(t / bin_s)] += n
    return [(i * bin_s, n / bin_s) for i, n in enumerate(bins)]


def in_flight_over_time(results: Sequence[RequestResult]) -> list[tuple[float, int]]:
    """(time in s, requests in flight from then on) at every start and end, failures included."""
    steps = sorted([(r.start_s, 1) for r in results] + [(r.end_s, -1) for r in results])
    out, now = [], 0
    for t, d in steps:
        now += d
        out.append((t, now))
    return out
