"""Metric arithmetic on hand-built request timings, and SSE parsing, without a server."""

from __future__ import annotations

import random

import numpy as np
import pytest

from batonlm.bench.client import RequestResult, chunk_text, parse_sse_line
from batonlm.bench.metrics import in_flight_over_time, output_tokens_over_time, percentile, stats, summarize


def test_percentile_matches_numpy():
    rng = random.Random(0)
    for n in (1, 2, 7, 100):
        xs = [rng.uniform(0, 10) for _ in range(n)]
        for q in (0, 50, 90, 99, 100):
            assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))
    assert stats([]) == {"mean": None, "median": None, "p90": None, "p99": None}


def ok(index: int, chunks: list[float], e2e: float, usage: int | None = None, start: float = 0.0) -> RequestResult:
    return RequestResult(index, prompt_len=10 * (index + 1), output_len=8, start_s=start, e2e_s=e2e,
                         chunk_times_s=chunks, usage_completion_tokens=usage, success=True)


def test_summary_by_hand():
    results = [
        ok(0, [0.1, 0.2, 0.4], 0.5),                 # 3 chunks, no usage: 3 tokens
        ok(1, [0.2, 0.3], 0.6, usage=5, start=0.5),  # usage says 5 tokens in 2 chunks
        RequestResult(2, 30, 8, error="HTTP 500: boom"),
        RequestResult(3, 40, 8, error="HTTP 500: boom"),
        RequestResult(4, 50, 8, error="timeout after 1 s"),
    ]
    s = summarize(results, duration_s=2.0, peak_concurrency=3)
    assert s["completed"] == 2 and s["failed"] == 3
    assert s["errors"] == {"HTTP 500: boom": 2, "timeout after 1 s": 1}
    assert list(s["errors"]) == ["HTTP 500: boom", "timeout after 1 s"]
    assert s["total_input_tokens"] == 10 + 20
    assert s["total_output_tokens"] == 3 + 5
    assert s["request_throughput"] == pytest.approx(1.0)
    assert s["input_throughput"] == pytest.approx(15.0)
    assert s["output_throughput"] == pytest.approx(4.0)
    assert s["total_token_throughput"] == pytest.approx(19.0)
    assert s["peak_concurrency"] == 3
    assert s["ttft_ms"]["mean"] == pytest.approx(150.0)
    assert s["ttft_ms"]["median"] == pytest.approx(150.0)
    # TPOT: (0.5 - 0.1) / 2 and (0.6 - 0.2) / 4.
    assert s["tpot_ms"]["mean"] == pytest.approx((200.0 + 100.0) / 2)
    # ITL pools the gaps of every request: 100, 200 and 100 ms.
    assert s["itl_ms"]["mean"] == pytest.approx(400.0 / 3)
    assert s["itl_ms"]["median"] == pytest.approx(100.0)
    assert s["itl_ms"]["p90"] == pytest.approx(float(np.percentile([100, 200, 100], 90)))
    assert s["e2e_ms"]["mean"] == pytest.approx(550.0)


def test_single_token_requests_have_no_tpot_and_no_itl():
    s = summarize([ok(0, [0.1], 0.1)], duration_s=1.0, peak_concurrency=1)
    assert s["tpot_ms"]["mean"] is None and s["itl_ms"]["p99"] is None
    assert s["ttft_ms"]["p99"] == pytest.approx(100.0)


def test_all_failed_summary_has_null_latencies():
    s = summarize([RequestResult(0, 5, 5, error="x")], duration_s=0.0, peak_concurrency=1)
    assert s["completed"] == 0 and s["request_throughput"] == 0.0
    assert all(v is None for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms") for v in s[key].values())


def test_output_tokens_over_time():
    series = output_tokens_over_time([ok(0, [0.1, 0.2, 1.4], 1.5, usage=6)], bin_s=1.0)
    assert series == [(0.0, 4.0), (1.0, 2.0)]


def test_sse_parsing():
    assert parse_sse_line('data: {"a": 1}') == '{"a": 1}'
    assert parse_sse_line("data:[DONE]") == "[DONE]"
    assert parse_sse_line(": keep-alive") is None
    assert parse_sse_line("event: message") is None
    assert parse_sse_line("") is None
    assert chunk_text({"choices": [{"text": "ab"}]}) == "ab"
    assert chunk_text({"choices": [{"delta": {"role": "assistant", "content": ""}}]}) == ""
    assert chunk_text({"choices": [{"delta": {"content": "hi"}}]}) == "hi"
    assert chunk_text({"choices": [], "usage": {"completion_tokens": 3}}) == ""


def test_in_flight_over_time():
    rs = [RequestResult(0, 1, 1, start_s=0.0, end_s=2.0), RequestResult(1, 1, 1, start_s=1.0, end_s=3.0),
          RequestResult(2, 1, 1, start_s=2.0, end_s=2.5)]
    # At t=2 one request ends as another starts: never three at once.
    assert [n for _, n in in_flight_over_time(rs)] == [1, 2, 1, 2, 1, 0]
