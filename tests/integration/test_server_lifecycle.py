"""Disconnects, metrics, scheduler death, shutdown, and streaming of multi-byte characters."""

import json
import os
import re
import signal
import threading
import time

import httpx
import pytest
from server_process import ServerProcess, children

CHAT = "/v1/chat/completions"
LONG = {"messages": [{"role": "user", "content": "Once upon a time"}], "max_tokens": 400, "ignore_eos": True,
        "stream": True}


def metric(base_url: str, name: str) -> float:
    text = httpx.get(base_url + "/metrics", timeout=30).text
    m = re.search(rf"^{name}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.M)
    assert m, f"{name} not in /metrics:\n{text}"
    return float(m.group(1))


def wait_until(cond, timeout: float = 10.0) -> float:
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout, "condition not reached in time"
        time.sleep(0.05)
    return time.monotonic() - t0


def test_metrics_are_exposed(server):
    httpx.post(server.base_url + "/v1/completions", json={"prompt": "Lily", "max_tokens": 5}, timeout=30)
    text = httpx.get(server.base_url + "/metrics", timeout=30).text
    for name in ("batonlm_num_requests_running", "batonlm_num_requests_waiting", "batonlm_kv_cache_usage_ratio",
                 "batonlm_prompt_tokens_total", "batonlm_generation_tokens_total",
                 "batonlm_time_to_first_token_seconds_bucket", "batonlm_inter_token_latency_seconds_bucket",
                 "batonlm_e2e_request_latency_seconds_bucket"):
        assert name in text, name
    assert metric(server.base_url, "batonlm_generation_tokens_total") >= 5
    assert metric(server.base_url, "batonlm_kv_cache_total_slots") > 0


def test_disconnect_mid_stream_frees_kv(server):
    base = server.base_url
    with httpx.Client(timeout=30) as c, c.stream("POST", base + CHAT, json=LONG) as r:
        lines = r.iter_lines()
        for _ in range(10):
            assert next(lines).startswith("data: ") or True
        assert metric(base, "batonlm_kv_cache_used_slots") > 0
        assert metric(base, "batonlm_num_requests_running") == 1
    # The client is gone: the request is aborted and its KV slots return.
    wait_until(lambda: metric(base, "batonlm_kv_cache_used_slots") == 0)
    assert metric(base, "batonlm_request_slots_used") == 0
    assert metric(base, "batonlm_num_requests_running") == 0


def test_disconnect_of_a_non_streaming_request_frees_kv(server):
    base = server.base_url
    body = {**LONG, "stream": False, "max_tokens": 500}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(base + CHAT, json=body, timeout=0.5)
    wait_until(lambda: metric(base, "batonlm_kv_cache_used_slots") == 0)


def test_streaming_multibyte_characters_never_breaks_one(server):
    base = server.base_url
    # Force byte-fallback tokens: bias the two bytes of "é" (C3 A9) and two of "🙂" (F0 9F ...).
    tok = {f"<0x{b:02X}>": 3 + b for b in range(256)}  # byte tokens are ids 3..258
    bias = {str(tok["<0xC3>"]): 30, str(tok["<0xA9>"]): 30, str(tok["<0xF0>"]): 20, str(tok["<0x9F>"]): 20,
            str(tok["<0x99>"]): 20, str(tok["<0x82>"]): 20}
    body = {"prompt": "Lily said", "max_tokens": 60, "logit_bias": bias, "seed": 3, "temperature": 1.0}
    full = httpx.post(base + "/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
    deltas = []
    with httpx.stream("POST", base + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                deltas.append(json.loads(line[6:])["choices"][0]["text"])
    streamed = "".join(deltas)
    assert streamed == full
    assert "é" in full, full  # multi-byte characters did go through the stream
    for d in deltas:
        d.encode("utf-8")  # no lone surrogates
    # A replacement character only where the final text has one (an invalid byte sequence).
    assert streamed.count("\ufffd") == full.count("\ufffd")


def _scheduler_pid(server: ServerProcess) -> int:
    return next(k for k in children(server.proc.pid) if "spawn_main" in open(f"/proc/{k}/cmdline").read())


def test_killing_the_scheduler_fails_requests_fast_and_exits():
    s = ServerProcess()
    try:
        descendants = s.descendants()
        results: list[tuple[str, float]] = []

        def stream_until_error():
            t = None
            try:
                with httpx.stream("POST", s.base_url + CHAT, json=LONG, timeout=30) as r:
                    for line in r.iter_lines():
                        if '"error"' in line:
                            t = time.monotonic()
                            results.append(("error", t))
                            return
                results.append(("ended", time.monotonic()))
            except httpx.HTTPError as e:
                results.append((type(e).__name__, time.monotonic()))

        threads = [threading.Thread(target=stream_until_error) for _ in range(3)]
        for t in threads:
            t.start()
        wait_until(lambda: metric(s.base_url, "batonlm_num_requests_running") == 3)
        killed_at = time.monotonic()
        os.kill(_scheduler_pid(s), signal.SIGKILL)
        for t in threads:
            t.join(10)
        assert len(results) == 3
        assert all(kind == "error" and at - killed_at < 2.0 for kind, at in results), results
        s.proc.wait(5.0 - (time.monotonic() - killed_at))
        assert s.proc.returncode not in (0, None)
        assert "scheduler process exited unexpectedly" in s.log()
        # Nothing is left behind: the device worker goes with its scheduler.
        wait_until(lambda: not [p for p in descendants if os.path.exists(f"/proc/{p}")], timeout=5)
    finally:
        s.stop()


def test_sigterm_shuts_everything_down_cleanly():
    s = ServerProcess()
    descendants = s.descendants()
    assert len(descendants) >= 2  # the scheduler and its device worker
    t0 = time.monotonic()
    assert s.stop() == 0
    assert time.monotonic() - t0 < 10
    wait_until(lambda: not [p for p in descendants if os.path.exists(f"/proc/{p}")], timeout=5)
    with pytest.raises(httpx.ConnectError):
        httpx.get(s.base_url + "/health", timeout=2)
