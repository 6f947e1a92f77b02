"""/metrics around a known workload: it parses with prometheus-client's own parser, each
histogram counted every request exactly once, the length histograms sum to the usage the answers
reported, finished requests are counted by reason, the overlap gauges are ratios, and every metric
the Grafana dashboard in docs/ queries exists.

The workload runs on the session's guarded server (conftest.py), which no test leaves a request
running on: what /metrics counts between a snapshot before the workload and one after is the
workload alone, as on a fresh server."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

DASHBOARD = Path(__file__).resolve().parents[2] / "docs" / "grafana-dashboard.json"


AUTH = {"Authorization": "Bearer sekrit"}


@pytest.fixture(scope="module")
def workload(guarded_server):
    url = guarded_server.base_url
    before = httpx.get(url + "/metrics", timeout=30).text
    usage = []
    for i in range(4):
        r = httpx.post(url + "/v1/completions", headers=AUTH, timeout=60, json={
            "prompt": "Once upon a time" * (i + 1), "max_tokens": 5 + i, "temperature": 0.0})
        usage.append(r.json()["usage"])
    with httpx.stream("POST", url + "/v1/chat/completions", headers=AUTH, timeout=60, json={
            "messages": [{"role": "user", "content": "Lily"}], "max_tokens": 6, "stream": True,
            "stream_options": {"include_usage": True}}) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    usage.append(events[-1]["usage"])
    return before, httpx.get(url + "/metrics", timeout=30).text, usage


def _samples(text: str) -> dict[str, float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k not in ("model_name",))
            out[f"{s.name}{{{labels}}}"] = s.value
    return out


def test_histograms_count_every_request(workload):
    before, after, usage = workload
    earlier, samples = _samples(before), _samples(after)
    counted = {k: v - earlier.get(k, 0.0) for k, v in samples.items()}  # during the workload
    n = len(usage)
    for name in ("batonlm_time_to_first_token_seconds", "batonlm_e2e_request_latency_seconds",
                 "batonlm_request_queue_time_seconds", "batonlm_request_prompt_tokens",
                 "batonlm_request_generation_tokens"):
        assert counted[f"{name}_count{{}}"] == n, name
        assert counted[f"{name}_bucket{{le=+Inf}}"] == n, name
    generated = sum(u["completion_tokens"] for u in usage)
    assert counted["batonlm_request_generation_tokens_sum{}"] == generated
    assert counted["batonlm_request_prompt_tokens_sum{}"] == sum(u["prompt_tokens"] for u in usage)
    # Every token after a request's first is one inter-token gap.
    assert counted["batonlm_inter_token_latency_seconds_count{}"] == generated - n
    assert counted["batonlm_requests_finished_total{finish_reason=length}"] == n
    for ratio in ("batonlm_overlap_hidden_cpu_ratio{}", "batonlm_device_idle_ratio{}", "batonlm_kv_cache_usage_ratio{}"):
        assert 0.0 <= samples[ratio] <= 1.0, ratio
    # The host side's cost: some CPU per iteration and per token, far below a second.
    for cost in ("batonlm_host_scheduler_cpu_per_iteration_seconds{}", "batonlm_host_main_cpu_per_token_seconds{}"):
        assert 0.0 < samples[cost] < 1.0, cost


def test_the_dashboard_queries_only_metrics_that_exist(workload):
    _, text, _ = workload
    families = {f.name for f in text_string_to_metric_families(text)}
    exposed = set()
    for f in text_string_to_metric_families(text):
        exposed |= {s.name for s in f.samples}
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    used = {m for e in exprs for m in re.findall(r"batonlm_[a-z0-9_]+", e)}
    assert len(used) >= 15
    missing = sorted(m for m in used if m not in exposed and m not in families)
    assert not missing, missing
