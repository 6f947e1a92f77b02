"""`batonlm bench` end to end against a fake server that streams at fixed, known delays."""

from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys

import pytest
from fake_openai_server import MODEL

from batonlm.bench.arrivals import arrival_offsets
from batonlm.bench.metrics import STAT_KEYS
from batonlm.bench.report import REQUEST_KEYS, TOP_LEVEL_KEYS

SUMMARY_KEYS = {
    "completed", "failed", "errors", "duration_s", "total_input_tokens", "total_output_tokens",
    "request_throughput", "input_throughput", "output_throughput", "total_token_throughput",
    "peak_concurrency", "ttft_ms", "tpot_ms", "itl_ms", "e2e_ms",
}
def at_least(value: float, expected_ms: float) -> bool:
    """The fake server's delays are sleeps: they never end early, and on a busy machine they may end
    any amount late, so a time is checked against its lower bound only (less 1 ms of clock
    granularity). Whether the bench measures the right intervals shows in how they add up."""
    return value >= expected_ms - 1.0


def test_timings_tokens_and_concurrency_cap(fake_server, run_cli, tokenizer):
    fake_server.ttft, fake_server.itl = 0.1, 0.03
    status, report = run_cli("--base-url", fake_server.base_url, "--num-prompts", "6", "--random-input-len", "40",
                             "--random-output-len", "5", "--max-concurrency", "2", "--api-key", "sekrit")
    assert status == 0
    s = report["summary"]
    assert s["completed"] == 6 and s["failed"] == 0 and s["errors"] == {}
    assert report["args"]["api_key"] == "<redacted>" and "sekrit" not in json.dumps(report)
    assert s["peak_concurrency"] == 2 and fake_server.peak_active == 2
    # 1 warmup + 6 counted requests, each with the exact body an OpenAI-compatible server expects.
    posts = fake_server.posts()
    assert len(posts) == 7
    for p in posts:
        assert p.path == "/v1/completions" and p.headers["authorization"] == "Bearer sekrit"
        b = p.body
        assert b["model"] == MODEL and b["stream"] is True and b["stream_options"] == {"include_usage": True}
        assert b["max_tokens"] == 5 and b["min_tokens"] == 5 and b["ignore_eos"] is True
        assert len(tokenizer.encode(b["prompt"])) == 40
    for r in report["requests"]:
        assert r["success"] and r["error"] is None
        assert r["output_tokens"] == 5 and r["prompt_len"] == 40 and r["server_prompt_tokens"] == 7
        assert at_least(r["ttft_ms"], 100.0), r
        assert len(r["itl_ms"]) == 4, r  # (a gap alone has no bound: a late chunk shortens the next gap)
        # E2E = TTFT + the gaps between tokens (+ the wait for [DONE]); TPOT is their mean.
        assert r["ttft_ms"] + sum(r["itl_ms"]) <= r["e2e_ms"] + 1e-6
        assert r["tpot_ms"] == pytest.approx((r["e2e_ms"] - r["ttft_ms"]) / 4)
        assert at_least(r["e2e_ms"], 100.0 + 4 * 30.0), r
        assert r["scheduled_s"] <= r["start_s"] and r["e2e_ms"] <= (r["end_s"] - r["start_s"]) * 1000 + 1e-6
    itl = [g for r in report["requests"] for g in r["itl_ms"]]
    ttft = [r["ttft_ms"] for r in report["requests"]]
    e2e = [r["e2e_ms"] for r in report["requests"]]
    assert s["ttft_ms"]["mean"] == pytest.approx(statistics.mean(ttft))
    assert s["itl_ms"]["median"] == pytest.approx(statistics.median(itl))
    assert s["e2e_ms"]["p99"] <= max(e2e) + 1e-6 and s["e2e_ms"]["median"] == pytest.approx(statistics.median(e2e))
    assert s["total_input_tokens"] == 240 and s["total_output_tokens"] == 30
    # Two at a time: at least three waves of 220 ms each (the peak of 2 says not more at once).
    assert s["duration_s"] >= 0.66 - 0.001
    assert s["duration_s"] >= max(r["end_s"] for r in report["requests"]) - 0.001
    assert s["request_throughput"] == pytest.approx(6 / s["duration_s"])
    assert s["output_throughput"] == pytest.approx(30 / s["duration_s"])


def test_inf_without_cap_sends_all_at_once(fake_server, run_cli):
    fake_server.ttft, fake_server.itl = 0.1, 0.01
    status, report = run_cli("--base-url", fake_server.base_url, "--num-prompts", "5", "--random-input-len", "8",
                             "--random-output-len", "3", "--warmup-requests", "0")
    assert status == 0
    assert report["summary"]["peak_concurrency"] == 5 and fake_server.peak_active == 5
    # All five in flight together (the peak above): one wave, sent before any answered.
    assert all(r["scheduled_s"] == 0.0 for r in report["requests"])
    assert max(r["start_s"] for r in report["requests"]) <= min(r["end_s"] for r in report["requests"])
    assert len(fake_server.posts()) == 5


def test_poisson_schedule_is_followed(fake_server, run_cli):
    fake_server.ttft, fake_server.itl = 0.01, 0.005
    status, report = run_cli("--base-url", fake_server.base_url, "--num-prompts", "25", "--request-rate", "25",
                             "--seed", "4", "--random-input-len", "8", "--random-output-len", "2")
    assert status == 0 and report["args"]["request_rate"] == 25.0
    expected = arrival_offsets(25, 25.0, seed=4)
    reqs = report["requests"]
    assert [r["scheduled_s"] for r in reqs] == pytest.approx(expected)
    for r in reqs:  # never sent before its time (how late a busy machine sends it is not the bench's)
        assert r["scheduled_s"] - 0.001 <= r["start_s"]
    assert report["summary"]["duration_s"] >= expected[-1]


def test_chat_endpoint_counts_usage_tokens(fake_server, run_cli):
    fake_server.ttft, fake_server.itl, fake_server.tokens_per_chunk = 0.1, 0.03, 2
    status, report = run_cli("--base-url", fake_server.base_url, "--endpoint", "chat", "--num-prompts", "3",
                             "--random-input-len", "16", "--random-output-len", "6")
    assert status == 0
    body = fake_server.posts()[-1].body
    assert fake_server.posts()[-1].path == "/v1/chat/completions"
    assert body["max_completion_tokens"] == 6 and "max_tokens" not in body
    assert body["messages"][0]["role"] == "user" and body["messages"][0]["content"]
    for r in report["requests"]:
        # Three chunks of two tokens: the usage chunk's count wins over the chunk count, and the
        # empty role-only first chunk does not count as the first token.
        assert r["output_tokens"] == 6 and len(r["itl_ms"]) == 2
        assert at_least(r["ttft_ms"], 100.0) and at_least(r["e2e_ms"], 160.0)
        assert r["tpot_ms"] == pytest.approx((r["e2e_ms"] - r["ttft_ms"]) / 5)
    assert report["summary"]["total_output_tokens"] == 18


def test_without_usage_chunks_are_counted(fake_server, run_cli):
    fake_server.ttft, fake_server.itl, fake_server.tokens_per_chunk = 0.02, 0.01, 2
    fake_server.send_usage = False
    status, report = run_cli("--base-url", fake_server.base_url, "--num-prompts", "2", "--random-input-len", "8",
                             "--random-output-len", "6")
    assert status == 0
    assert [r["output_tokens"] for r in report["requests"]] == [3, 3]
    assert all(r["server_prompt_tokens"] is None for r in report["requests"])


def test_failed_requests_are_counted_not_fatal(fake_server, run_cli):
    fake_server.ttft, fake_server.itl = 0.03, 0.01
    # POST 1 is the warmup; with one request at a time, POST n carries request n - 2.
    fake_server.failures = {3: "500", 4: "drop", 5: "error", 6: "stall", 7: "no_done"}
    status, report = run_cli("--base-url", fake_server.base_url, "--num-prompts", "8", "--random-input-len", "8",
                             "--random-output-len", "3", "--max-concurrency", "1", "--timeout", "0.5")
    assert status == 0
    s = report["summary"]
    assert s["completed"] == 3 and s["failed"] == 5 and sum(s["errors"].values()) == 5
    errors = [r["error"] for r in report["requests"]]
    assert errors[0] is None and errors[6] is None and errors[7] is None
    assert errors[1].startswith("HTTP 500") and "boom" in errors[1]
    assert "RemoteProtocolError" in errors[2]
    assert errors[3] == "error in stream: engine exploded"
    assert errors[4] == "timeout after 0.5 s"
    assert errors[5] == "stream ended without data: [DONE]"
    for r in report["requests"]:
        if not r["success"]:
            assert r["ttft_ms"] is None and r["e2e_ms"] is None and r["tpot_ms"] is None and r["itl_ms"] == []
    assert s["total_output_tokens"] == 9
    assert at_least(s["e2e_ms"]["p99"], 30.0 + 2 * 10.0)


def test_unreachable_server_fails_cleanly(run_cli):
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    status, report = run_cli("--base-url", url, "--model", "m", "--num-prompts", "3", "--random-input-len", "8")
    assert status == 1
    assert report["summary"]["failed"] == 3 and report["summary"]["completed"] == 0
    assert all(r["error"].startswith("ConnectError") for r in report["requests"])
    # Without --model the server is asked for one first; that failing is an error, not a crash.
    assert run_cli("--base-url", url, "--num-prompts", "3") == (1, None)


def test_json_schema_is_stable(fake_server, run_cli):
    fake_server.ttft, fake_server.itl = 0.01, 0.005
    fake_server.failures = {2: "500"}
    status, report = run_cli("--base-url", fake_server.base_url, "--num-prompts", "3", "--random-input-len", "8",
                             "--random-output-len", "3")
    assert status == 0
    assert set(report) == set(TOP_LEVEL_KEYS) == {
        "schema_version", "tool", "batonlm_version", "created", "args", "summary", "bench_serving", "requests"}
    bs, summary = report["bench_serving"], report["summary"]
    assert bs["completed"] == summary["completed"] == 2 and bs["duration"] == summary["duration_s"]
    for ours, theirs in (("ttft_ms", "ttft"), ("tpot_ms", "tpot"), ("itl_ms", "itl"), ("e2e_ms", "e2e_latency")):
        assert bs[f"mean_{theirs}_ms"] == pytest.approx(summary[ours]["mean"])
        assert bs[f"median_{theirs}_ms"] == pytest.approx(summary[ours]["median"])
        assert bs[f"p99_{theirs}_ms"] == pytest.approx(summary[ours]["p99"])
        assert summary[ours]["median"] <= bs[f"p95_{theirs}_ms"] <= bs[f"p99_{theirs}_ms"]
    assert report["schema_version"] == 1 and report["tool"] == "batonlm bench"
    assert set(report["summary"]) == SUMMARY_KEYS
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        assert set(report["summary"][key]) == set(STAT_KEYS) == {"mean", "median", "p90", "p99"}
    assert len(report["requests"]) == 3
    for r in report["requests"]:
        assert tuple(r) == REQUEST_KEYS
    assert set(REQUEST_KEYS) == {
        "index", "group", "prompt_len", "output_len", "output_tokens", "server_prompt_tokens", "success",
        "error", "scheduled_s", "start_s", "end_s", "ttft_ms", "tpot_ms", "e2e_ms", "itl_ms"}
    args = report["args"]
    assert args["model"] == MODEL and args["request_rate"] == "inf" and args["num_prompts"] == 3
    assert {"base_url", "endpoint", "dataset", "random_input_len", "max_concurrency", "seed"} <= set(args)


def test_shared_prefix_run_reports_groups(fake_server, run_cli):
    fake_server.ttft, fake_server.itl = 0.01, 0.005
    status, report = run_cli("--base-url", fake_server.base_url, "--dataset", "shared-prefix",
                             "--shared-prefix-groups", "2", "--shared-prefix-questions", "3",
                             "--shared-prefix-len", "50", "--shared-prefix-question-len", "10",
                             "--random-output-len", "2", "--warmup-requests", "0")
    assert status == 0 and report["summary"]["completed"] == 6
    assert sorted(r["group"] for r in report["requests"]) == [0, 0, 0, 1, 1, 1]
    prompts = [p.body["prompt"] for p in fake_server.posts()]
    heads = {p.split("\n\n")[0] for p in prompts}
    assert len(heads) == 2  # two distinct shared system prompts on the wire


def test_plot_writes_png(fake_server, run_cli, tmp_path):
    pytest.importorskip("matplotlib")
    fake_server.ttft, fake_server.itl = 0.01, 0.005
    png = tmp_path / "bench.png"
    status, _ = run_cli("--base-url", fake_server.base_url, "--num-prompts", "6", "--random-input-len", "8",
                        "--random-output-len", "4", "--random-range-ratio", "0.5", "--plot", str(png))
    assert status == 0
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_bad_arguments(run_cli):
    assert run_cli("--warmup-requests", "-1") == (2, None)
    assert run_cli("--random-range-ratio", "2") == (2, None)
    with pytest.raises(SystemExit):
        run_cli("--request-rate", "0")


def test_module_entry_point(fake_server):
    fake_server.ttft, fake_server.itl = 0.01, 0.005
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "batonlm.bench", "--base-url", fake_server.base_url, "--num-prompts", "3",
         "--random-input-len", "8", "--random-output-len", "3", "--disable-progress-bar"],
        capture_output=True, text=True, timeout=120, env=env,
    )
    assert proc.returncode == 0, proc.stderr
    assert "Completed requests:" in proc.stdout and "TTFT" in proc.stdout and MODEL in proc.stdout
    assert len(fake_server.posts()) == 4


def test_sharegpt_replay(fake_server, run_cli, tmp_path, tokenizer):
    fake_server.ttft, fake_server.itl = 0.01, 0.005
    story = "Once upon a time, there was a little girl named Lily. She loved to play outside."
    convs = [{"id": str(i), "conversations": [{"from": "human", "value": f"{story} Question {i}?"},
                                              {"from": "gpt", "value": " ".join(["yes"] * (4 + i))}]}
             for i in range(5)]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(convs))
    status, report = run_cli("--base-url", fake_server.base_url, "--dataset", "sharegpt", "--dataset-path",
                             str(path), "--num-prompts", "3", "--warmup-requests", "0")
    assert status == 0 and report["summary"]["completed"] == 3 and report["bench_serving"]["completed"] == 3
    sent = {p.body["prompt"] for p in fake_server.posts()}
    assert all(p.startswith(story) for p in sent) and len(sent) == 3
    assert sorted(r["prompt_len"] for r in report["requests"]) == sorted(len(tokenizer.encode(p)) for p in sent)
    status, _ = run_cli("--base-url", fake_server.base_url, "--dataset", "sharegpt")
    assert status == 2  # no --dataset-path
