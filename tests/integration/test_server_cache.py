"""The prefix cache through the API: cached tokens in usage and meta, /flush_cache, /metrics."""

from __future__ import annotations

import httpx
from live_helpers import metric, wait_until

SYSTEM = "You are a storyteller. Tell a short story about a dog, a cat and a big red ball in the park."


def _chat(url: str, question: str, headers: dict | None = None, **extra) -> httpx.Response:
    body = {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
            "max_tokens": 4, "temperature": 0, **extra}
    return httpx.post(url + "/v1/chat/completions", json=body, headers=headers, timeout=60)


def test_cached_tokens_are_reported_and_the_cache_can_be_flushed(server):
    url = server.base_url
    assert httpx.post(url + "/flush_cache", timeout=30).json() == {"status": "ok"}
    assert metric(url, "batonlm_kv_cache_evictable_slots") == 0
    first = _chat(url, "Once upon a time").json()["usage"]
    second = _chat(url, "Once upon a time, a dog").json()["usage"]
    assert first["prompt_tokens_details"]["cached_tokens"] == 0
    cached = second["prompt_tokens_details"]["cached_tokens"]
    assert 20 < cached < second["prompt_tokens"]  # the system prompt and more, never all
    assert metric(url, "batonlm_kv_cache_evictable_slots") > 0
    assert 0 < metric(url, "batonlm_prefix_cache_hit_ratio") < 1
    gen = httpx.post(url + "/generate", json={"text": SYSTEM, "sampling_params": {"max_new_tokens": 2}}, timeout=60)
    assert gen.json()["meta_info"]["cached_tokens"] > 20
    # Streamed with usage: the same count in the last event.
    with httpx.Client(timeout=60) as c, c.stream("POST", url + "/v1/chat/completions", json={
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi"}],
            "max_tokens": 3, "stream": True, "stream_options": {"include_usage": True}}) as r:
        events = [line for line in r.iter_lines() if line.startswith("data: {")]
    assert '"cached_tokens":' in events[-1] and '"cached_tokens":0' not in events[-1]


def test_flush_cache_refuses_while_requests_run(server):
    url = server.base_url
    # 16 choices of 480 tokens: 480 steps at least, far longer than the flush request takes.
    with httpx.Client(timeout=60) as c, c.stream("POST", url + "/v1/completions", json={
            "prompt": "Once", "max_tokens": 480, "n": 16, "ignore_eos": True, "stream": True}) as r:
        lines = r.iter_lines()  # held: a dropped iterator closes the stream
        next(lines)
        refused = httpx.post(url + "/flush_cache", timeout=30)
        assert refused.status_code == 400 and refused.json()["error"]["code"] == "requests_running"
    wait_until(lambda: metric(url, "batonlm_kv_cache_used_slots") == 0, what="the stream's KV released")
    wait_until(lambda: httpx.post(url + "/flush_cache", timeout=30).status_code == 200, what="a flush once idle")
    assert metric(url, "batonlm_kv_cache_evictable_slots") == 0


def test_disable_radix_cache(guarded_server):
    """--disable-radix-cache (on the session's server with an API key, test_server_errors.py)."""
    url, auth = guarded_server.base_url, {"Authorization": "Bearer sekrit"}
    for _ in range(2):
        usage = _chat(url, "Once upon a time", headers=auth).json()["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] == 0
    assert metric(url, "batonlm_kv_cache_evictable_slots") == 0
