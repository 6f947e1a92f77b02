"""/metrics on a fresh server after a known workload: it parses with prometheus-client's own
parser, each histogram counted every request exactly once, the length histograms sum to the
usage the answers reported, finished requests are counted by reason, the overlap gauges are
ratios, and every metric the Grafana dashboard in docs/ queries exists."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from batonlm.bench.server_process import ServerProcess

DASHBOARD = Path(__file__).resolve().parents[2] / "docs" / "grafana-dashboard.json"


@pytest.fixture(scope="module")
def workload():
    server = ServerProcess()
    try:
        url = server.base_url
        usage = []
        for i in range(4):
            r = httpx.post(url + "/v1/completions", json={"prompt": "Once upon a time" * (i + 1), "max_tokens": 5 + i,
                                                          "temperature": 0.0}, timeout=60)
            usage.append(r.json()["usage"])
        with httpx.stream("POST", url + "/v1/chat/completions", timeout=60, json={
                "messages": [{"role": "user", "content": "Lily"}], "max_tokens": 6, "stream": True,
                "stream_options": {"include_usage": True}}) as r:
            events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        usage.append(events[-1]["usage"])
        text = httpx.get(url + "/metrics", timeout=30).text
        yield text, usage
    finally:
        assert server.stop() == 0


def _samples(text: str) -> dict[str, float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k not in ("model_name",))
            out[f"{s.name}{{{labels}}}"] = s.value
    return out


def test_histograms_count_every_request(workload):
    text, usage = workload
    samples = _samples(text)
    n = len(usage)
    for name in ("batonlm_time_to_first_token_seconds", "batonlm_e2e_request_latency_seconds",
                 "batonlm_request_queue_time_seconds", "batonlm_request_prompt_tokens",
                 "batonlm_request_generation_tokens"):
        assert samples[f"{name}_count{{}}"] == n, name
        assert samples[f"{name}_bucket{{le=+Inf}}"] == n, name
    generated = sum(u["completion_tokens"] for u in usage)
    assert samples["batonlm_request_generation_tokens_sum{}"] == generated
    assert samples["batonlm_request_prompt_tokens_sum{}"] == sum(u["prompt_tokens"] for u in usage)
    # Every token after a request's first is one inter-token gap.
    assert samples["batonlm_inter_token_latency_seconds_count{}"] == generated - n
    assert samples["batonlm_requests_finished_total{finish_reason=length}"] == n
    for ratio in ("batonlm_overlap_hidden_cpu_ratio{}", "batonlm_device_idle_ratio{}", "batonlm_kv_cache_usage_ratio{}"):
        assert 0.0 <= samples[ratio] <= 1.0, ratio


def test_the_dashboard_queries_only_metrics_that_exist(workload):
    text, _ = workload
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
