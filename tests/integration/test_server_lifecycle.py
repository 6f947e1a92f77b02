"""Disconnects, metrics, scheduler death, shutdown, and streaming of multi-byte characters."""

import json
import os
import signal
import threading
import time

import httpx
import pytest
from live_helpers import metric, wait_until

from batonlm.bench.server_process import ServerProcess
from batonlm.process_tree import children

CHAT = "/v1/chat/completions"
LONG = {"messages": [{"role": "user", "content": "Once upon a time"}], "max_tokens": 400, "ignore_eos": True,
        "stream": True}


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


CYCLE = "é🙂中 "  # 2-, 4- and 3-byte characters and a space: 10 distinct bytes


@pytest.fixture(scope="module")
def byte_cycle_server(tmp_path_factory):
    from helpers import build_byte_cycle_model, copy_tokenizer

    path = tmp_path_factory.mktemp("byte_cycle")
    build_byte_cycle_model(path, CYCLE)
    copy_tokenizer(path)
    s = ServerProcess(str(path), "--served-model-name", "cycle")
    s.model_dir = path  # type: ignore[attr-defined]
    yield s
    assert s.stop() == 0


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_streaming_multibyte_characters_never_breaks_one(byte_cycle_server, endpoint):
    """Every character of the output spans 2-4 byte-fallback tokens; no streamed delta may
    hold part of one (which would show as U+FFFD), and the deltas add up to the full text."""
    base = byte_cycle_server.base_url
    if endpoint == "chat":
        path, body = CHAT, {"messages": [{"role": "user", "content": "中"}]}  # ends on the cycle's <0xAD>
    else:
        path, body = "/v1/completions", {"prompt": [1]}
    body = {**body, "model": "cycle", "max_tokens": 40, "temperature": 0}  # 4 whole cycles of 10 bytes
    full = httpx.post(base + path, json=body, timeout=60).json()
    text = full["choices"][0]["message"]["content"] if endpoint == "chat" else full["choices"][0]["text"]
    deltas = []
    with httpx.stream("POST", base + path, json={**body, "stream": True}, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                choice = json.loads(line[6:])["choices"][0]
                deltas.append(choice["delta"].get("content", "") if endpoint == "chat" else choice["text"])
    assert "".join(deltas) == text
    assert "\ufffd" not in text and all("\ufffd" not in d for d in deltas)
    if endpoint == "completions":  # the prompt is BOS alone: the cycle from its start
        assert text == CYCLE * 4
    # Multi-byte characters did stream, in more than one delta (how many tokens a delta carries
    # depends on when the client reads).
    assert sum(len(d.encode()) > len(d) for d in deltas if d) >= 2


def test_the_ready_line_states_the_kv_pool_and_the_memory_held(byte_cycle_server):
    """The KV pool's size (every slot of every layer's K and V in float32, from the model's
    config) and the resident memory of the server's processes (main, scheduler, device worker)."""
    import re

    line = next(ln for ln in byte_cycle_server.log().splitlines() if "batonlm ready on" in ln)
    m = re.search(r"(\d+) KV slots in ([0-9.]+) MiB, .*; ([0-9.]+) (MiB|GiB) resident in (\d+) processes", line)
    assert m, line
    cfg = json.loads((byte_cycle_server.model_dir / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    per_token = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * 4
    assert float(m[2]) == pytest.approx((int(m[1]) + 1) * per_token / 2**20, abs=0.05)
    held = float(m[3]) * (2**30 if m[4] == "GiB" else 2**20)
    assert 50 * 2**20 < held < 8 * 2**30 and int(m[5]) >= 3, line


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

        def non_streaming():
            try:
                r = httpx.post(s.base_url + CHAT, json={**LONG, "stream": False}, timeout=30)
                results.append((f"status {r.status_code} {r.json()['error']['type']}", time.monotonic()))
            except httpx.HTTPError as e:
                results.append((type(e).__name__, time.monotonic()))

        threads = [threading.Thread(target=stream_until_error) for _ in range(3)]
        threads.append(threading.Thread(target=non_streaming))
        for t in threads:
            t.start()
        wait_until(lambda: metric(s.base_url, "batonlm_num_requests_running") == 4)
        killed_at = time.monotonic()
        os.kill(_scheduler_pid(s), signal.SIGKILL)
        for t in threads:
            t.join(10)
        assert len(results) == 4
        assert all(at - killed_at < 2.0 for _, at in results), results
        assert sorted(kind for kind, _ in results) == ["error"] * 3 + ["status 503 service_unavailable"], results
        s.proc.wait(5.0 - (time.monotonic() - killed_at))
        assert s.proc.returncode not in (0, None)
        assert "scheduler process exited unexpectedly" in s.log()
        # Nothing is left behind: the device worker goes with its scheduler.
        wait_until(lambda: not [p for p in descendants if os.path.exists(f"/proc/{p}")], timeout=5)
    finally:
        s.stop()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_a_signal_to_the_whole_process_group_shuts_everything_down_cleanly(sig):
    """Ctrl-C in a terminal sends SIGINT to the whole process group (main, scheduler, worker);
    systemd (KillMode=control-group), `timeout` and `kill -- -PGID` send SIGTERM to all of them.
    The scheduler then exits by itself, and the main process must not wait for ever to tell it
    to (a ZMQ PUSH send with no peer blocks its sender)."""
    s = ServerProcess(new_session=True)
    descendants = s.descendants()
    os.killpg(s.proc.pid, sig)
    assert s.proc.wait(30) == 0, s.log()
    wait_until(lambda: not [p for p in descendants if os.path.exists(f"/proc/{p}")], timeout=5)
    assert "Traceback" not in s.log(), s.log()
    s.stop()


def test_an_orphaned_scheduler_and_worker_exit():
    """If the main process is killed outright, its scheduler and device worker must not keep
    running (and holding memory) for requests nobody will read."""
    s = ServerProcess()
    try:
        descendants = s.descendants()
        def request():
            with pytest.raises(httpx.HTTPError):  # the server is killed under it
                httpx.post(s.base_url + CHAT, json={**LONG, "stream": False}, timeout=30)

        threading.Thread(target=request, daemon=True).start()
        wait_until(lambda: metric(s.base_url, "batonlm_num_requests_running") == 1)
        s.proc.kill()
        wait_until(lambda: not [p for p in descendants if os.path.exists(f"/proc/{p}")], timeout=10)
    finally:
        s.stop()
