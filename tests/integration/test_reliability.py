"""No request can take the server down or stall it: a test per defect the hostile-input probe
found (issue 10), against live servers."""

from __future__ import annotations

import json
import os
import signal
import threading

import httpx
import pytest
from live_helpers import closed_by_server, connect, metric, open_fds, request_bytes, wait_until

from batonlm.bench.server_process import ServerProcess
from batonlm.process_tree import children

CHAT, COMP, GEN = "/v1/chat/completions", "/v1/completions", "/generate"
MSG = [{"role": "user", "content": "Once upon a time"}]
BASIC = {CHAT: {"messages": MSG, "max_tokens": 4}, COMP: {"prompt": "Once", "max_tokens": 4}, GEN: {"text": "Once"}}
TOO_BIG = [2**63, 2**64 - 1, 2**64 + 5, 10**30, -(2**63) - 1]


def _error(r: httpx.Response, status: int, param: str | None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["request_id"] == r.headers["x-request-id"]
    if param is not None:  # the field, or an element of it ("stop_token_ids.0")
        assert err["param"] == param or err["param"].startswith(param + "."), err
    assert "Traceback" not in r.text and "File \"" not in r.text
    return err


def _healthy(base_url: str) -> None:
    assert httpx.get(base_url + "/health", timeout=30).status_code == 200
    r = httpx.post(base_url + CHAT, json={"messages": MSG, "max_tokens": 8, "temperature": 0}, timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"].startswith(", there was")


# ---------------------------------------------------------------- 1. integers out of range


@pytest.mark.parametrize("value", TOO_BIG, ids=["2^63", "2^64-1", "2^64+5", "1e30", "-2^63-1"])
def test_integers_beyond_64_bits_are_400s_and_the_server_lives(server, value):
    cases = [(CHAT, "top_k"), (CHAT, "max_tokens"), (CHAT, "min_tokens"), (CHAT, "seed"), (CHAT, "n"),
             (COMP, "top_k"), (COMP, "logprobs")]
    for path, field in cases:
        for stream in (False, True):
            r = httpx.post(server.base_url + path, json={**BASIC[path], field: value, "stream": stream}, timeout=30)
            _error(r, 400, field)  # a 400 before any stream starts, never a 200 then an error
    for field in ("top_k", "min_new_tokens", "max_new_tokens", "seed"):
        r = httpx.post(server.base_url + GEN, json={"text": "hi", "sampling_params": {field: value}}, timeout=30)
        _error(r, 400, f"sampling_params.{field}")
    for path, body, param in ((CHAT, {"messages": MSG, "stop_token_ids": [value]}, "stop_token_ids"),
                              (CHAT, {"messages": MSG, "logit_bias": {str(value): 1}}, "logit_bias"),
                              (GEN, {"input_ids": [1, value]}, "input_ids")):
        _error(httpx.post(server.base_url + path, json=body, timeout=30), 400, param)
    _healthy(server.base_url)


# ---------------------------------------------------------------- 5. bodies the parser chokes on


@pytest.mark.parametrize("path", [CHAT, COMP, GEN])
def test_hostile_json_is_a_400(server, path):
    bodies = [
        b'{"prompt": ' + b"[" * 1000 + b"]" * 1000 + b"}",  # nested 1000 deep
        b'{"messages": ' + b'{"a":' * 3000 + b"1" + b"}" * 3000 + b"}",
        b'{"max_tokens": ' + b"7" * 5000 + b"}",  # an integer literal of 5000 digits
        b'{"prompt": "\\ud800", "text": "\\ud800"}',  # a lone surrogate
        b'{"text": "\xed\xa0\x80"}',  # the same as raw (invalid) UTF-8
    ]
    for body in bodies:
        r = httpx.post(server.base_url + path, content=body, headers={"content-type": "application/json"}, timeout=30)
        assert r.status_code == 400, (body[:40], r.text)
        _error(r, 400, None)
    # Lone surrogates that parse (a valid JSON escape pair) are fine; nested content is a 400.
    chat = {"messages": [{"role": "user", "content": [[[[["x"]]]]]}]}
    _error(httpx.post(server.base_url + CHAT, json=chat, timeout=30), 400, None)
    _healthy(server.base_url)


# ---------------------------------------------------------------- 2. caps on what one request asks


@pytest.fixture(scope="module")
def limited():
    s = ServerProcess(
        "--max-stop-strings", "4", "--max-stop-string-length", "32", "--max-prompts-per-request", "4",
        "--max-n", "16", "--max-logit-bias", "3", "--max-stop-token-ids", "3", "--max-logprobs", "5",
        "--client-timeout", "1.5", "--max-request-bytes", "200000", "--max-stream-backlog", "8",
        "--max-running-requests", "4", "--max-queued-requests", "12", "--max-connections", "40",
    )
    yield s
    assert s.stop() == 0, s.log()


def test_caps_on_one_request_name_the_field(limited):
    url = limited.base_url
    cases = [
        (GEN, {"text": "hi", "sampling_params": {"stop": ["s"] * 10_000}}, "sampling_params.stop"),
        (GEN, {"text": "hi", "sampling_params": {"stop": "x" * 33}}, "sampling_params.stop"),
        (GEN, {"text": "hi", "sampling_params": {"logit_bias": {"1": 1, "2": 1, "3": 1, "4": 1}}},
         "sampling_params.logit_bias"),
        (GEN, {"text": "hi", "sampling_params": {"stop_token_ids": [1, 2, 3, 4]}}, "sampling_params.stop_token_ids"),
        (GEN, {"text": "hi", "sampling_params": {"logprobs": 6}}, "sampling_params.logprobs"),
        (COMP, {"prompt": ["a"] * 2000, "n": 4}, "prompt"),
        (COMP, {"prompt": [[1, 2]] * 5}, "prompt"),
        (COMP, {"prompt": "a", "n": 17}, "n"),
        (CHAT, {"messages": MSG, "stop": ["a", "b", "c", "d", "e"]}, "stop"),
        (CHAT, {"messages": MSG, "logprobs": True, "top_logprobs": 6}, "top_logprobs"),
        (CHAT, {"messages": MSG, "logit_bias": {"1": 1, "2": 1, "3": 1, "4": 1}}, "logit_bias"),
        (COMP, {"prompt": "a", "stop_token_ids": [1, 2, 3, 4]}, "stop_token_ids"),
    ]
    for path, body, param in cases:
        err = _error(httpx.post(url + path, json=body, timeout=30), 400, param)
        assert err["code"] in ("limit_exceeded", "invalid_value"), err
    _error(httpx.post(url + COMP, json={"prompt": "x" * 250_000}, timeout=30), 413, None)
    # Within the caps, all is served.
    ok = httpx.post(url + COMP, json={"prompt": ["a", "b"], "n": 1, "max_tokens": 2, "stop": ["zz"] * 4}, timeout=60)
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 2


def test_generate_is_as_strict_as_the_openai_routes(server):
    for sp, param in (({"temperature": "8"}, "temperature"), ({"temperature": 5}, "temperature"),
                      ({"top_p": "0.5"}, "top_p"), ({"max_new_tokens": 1.5}, "max_new_tokens"),
                      ({"ignore_eos": 1}, "ignore_eos"), ({"stop": [""]}, "stop")):
        _error(httpx.post(server.base_url + GEN, json={"text": "hi", "sampling_params": sp}, timeout=30), 400,
               f"sampling_params.{param}")


def test_long_prompts_are_tokenized_off_the_event_loop(stories_path):
    """A long text, or many prompts that are long together, are tokenized in batonlm's own pool
    (the tokenizers library releases the GIL), so the event loop keeps serving other requests."""
    import asyncio

    from batonlm.config import ServerArgs
    from batonlm.tokenizer_manager.manager import TokenizerManager
    from batonlm.tokenizer_manager.offload import INLINE_CHARS
    from batonlm.tokenizer_manager.tokenizer import load_tokenizer

    tok = load_tokenizer(stories_path)
    threads = []

    class Spy:
        def __call__(self, text, **kwargs):
            threads.append(threading.current_thread().name)
            return tok(text, **kwargs)

    manager = TokenizerManager(ServerArgs(), Spy(), launch=None)  # type: ignore[arg-type]
    many = ["Once upon a time. " * 60] * (INLINE_CHARS // 1000 + 1)  # each short, together long

    async def main():
        short = await manager.tokenize_async("Once upon a time")
        long = await manager.tokenize_async("Once upon a time. " * (INLINE_CHARS // 10))
        batch = await manager.tokenize_many_async(many)
        return threading.current_thread().name, short, long, batch

    loop_thread, short, long, batch = asyncio.run(main())
    assert threads[0] == loop_thread
    assert threads[1].startswith("batonlm-text") and threads[2].startswith("batonlm-text"), threads
    assert short == list(tok("Once upon a time").input_ids) and len(long) > INLINE_CHARS // 10
    assert batch == [list(tok(p).input_ids) for p in many]


# ---------------------------------------------------------------- 3. slow and silent clients


def test_silent_and_trickling_connections_are_closed(limited):
    url = limited.base_url
    fds_before = open_fds(limited.proc.pid)
    silent = [connect(url) for _ in range(20)]
    head = connect(url)
    head.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # ... and never the rest
    trickle = connect(url)
    stop = threading.Event()

    def drip() -> None:  # one byte every 0.2 s: a head that would never end
        try:
            while not stop.wait(0.2):
                trickle.send(b"X")
        except OSError:
            pass

    trickle.sendall(b"POST /v1/completions HTTP/1.1\r\nX-Slow: ")
    threading.Thread(target=drip, daemon=True).start()
    try:
        for s in [*silent, head, trickle]:
            assert closed_by_server(s, timeout=30) == b""  # closed with nothing sent
    finally:
        stop.set()
    for s in [*silent, head, trickle]:
        s.close()
    wait_until(lambda: open_fds(limited.proc.pid) <= fds_before, what="the server's file descriptors back")


def test_a_body_that_arrives_too_slowly_gets_a_408(limited):
    s = connect(limited.base_url)
    s.sendall(request_bytes(COMP, b'{"prompt": "a', content_length=100))  # 87 bytes never come
    answer = closed_by_server(s, timeout=30)
    s.close()
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert b'"code":"request_timeout"' in answer


def test_too_many_connections_get_a_503_and_existing_ones_are_served(limited):
    url = limited.base_url
    held = [connect(url) for _ in range(45)]  # the limit is 40
    try:
        refused = [s for s in held[40:] if closed_by_server(s, timeout=30).startswith(b"HTTP/1.1 503")]
        assert len(refused) == 5
    finally:
        for s in held:
            s.close()
    wait_until(lambda: httpx.get(url + "/health", timeout=30).status_code == 200, what="health after the storm")


def test_a_stream_whose_client_never_reads_is_aborted(limited):
    url = limited.base_url
    aborted = metric(url, "batonlm_requests_finished_total", 'finish_reason="abort"')
    # ~10 MB of events: more than the kernel's socket buffers (4 MB at most) hold.
    body = json.dumps({"messages": MSG, "n": 16, "max_tokens": 480, "ignore_eos": True, "stream": True,
                       "logprobs": True, "top_logprobs": 5}).encode()
    s = connect(url, rcvbuf=4096)
    s.sendall(request_bytes(CHAT, body))
    assert s.recv(64).startswith(b"HTTP/1.1 200")
    # Never read again: the server stops buffering (the stream falls 8 outputs behind), aborts
    # the choices and frees their KV, and cuts the connection once nothing is read for 1.5 s.
    wait_until(lambda: metric(url, "batonlm_requests_finished_total", 'finish_reason="abort"') > aborted,
               what="the stream's choices aborted")
    wait_until(lambda: metric(url, "batonlm_kv_cache_used_slots") == 0, what="KV freed")
    closed_by_server(s, timeout=30)
    s.close()
    assert "fell 8 outputs behind" in limited.log()


# ---------------------------------------------------------------- admission control


def test_a_full_queue_answers_429_with_retry_after(limited):
    url = limited.base_url
    # 16 choices of 480 tokens: 4 running and 12 queued, the most this server takes, for at
    # least the time of 4 x 480 steps.
    long = {"messages": MSG, "n": 16, "max_tokens": 480, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60) as c, c.stream("POST", url + CHAT, json=long) as st:
        assert st.status_code == 200
        r = httpx.post(url + CHAT, json={"messages": MSG, "max_tokens": 2}, timeout=30)
        err = _error(r, 429, None)
        assert err["code"] == "queue_full" and r.headers["retry-after"] == "1"
        _error(httpx.post(url + COMP, json={"prompt": "a", "max_tokens": 2}, timeout=30), 429, None)
    wait_until(lambda: metric(url, "batonlm_kv_cache_used_slots") == 0, what="KV freed")
    assert httpx.post(url + CHAT, json={"messages": MSG, "max_tokens": 2}, timeout=60).status_code == 200


# ---------------------------------------------------------------- 4. disconnects, quietly


def test_disconnects_are_quiet_and_free_everything(server):
    url = server.base_url
    log_before = len(server.log())
    aborted = metric(url, "batonlm_requests_finished_total", 'finish_reason="abort"')
    # A non-streamed request whose client goes away mid-generation.
    s = connect(url)
    s.sendall(request_bytes(CHAT, json.dumps({"messages": MSG, "max_tokens": 480, "ignore_eos": True}).encode()))
    wait_until(lambda: metric(url, "batonlm_num_requests_running") == 1, what="the request running")
    s.close()
    # A client that disconnects half-way through sending its body.
    s = connect(url)
    s.sendall(request_bytes(CHAT, b'{"messages": [', content_length=500))
    s.close()
    wait_until(lambda: metric(url, "batonlm_requests_finished_total", 'finish_reason="abort"') >= aborted + 1,
               what="the abort counted")
    wait_until(lambda: metric(url, "batonlm_kv_cache_used_slots") == 0, what="KV freed")
    # Aborted requests count in the totals too (8. of the issue).
    assert metric(url, "batonlm_prompt_tokens_total") > 0
    new_log = server.log()[log_before:]
    for bad in ("Traceback", "InvalidStateError", "ClientDisconnect", "Exception"):
        assert bad not in new_log, new_log[-3000:]


# ---------------------------------------------------------------- 6. failures say nothing inside


def _device_worker(server: ServerProcess) -> int:
    """The CPU device worker: the scheduler's child (not multiprocessing's resource tracker)."""
    def spawned(pid: int) -> bool:
        return b"resource_tracker" not in open(f"/proc/{pid}/cmdline", "rb").read()

    (scheduler,) = [p for p in children(server.proc.pid) if spawned(p)]
    (worker,) = [p for p in children(scheduler) if spawned(p)]
    return worker


def test_a_device_failure_reaches_clients_without_internals():
    s = ServerProcess()
    try:
        with httpx.Client(timeout=60) as c, c.stream("POST", s.base_url + CHAT, json={
                "messages": MSG, "max_tokens": 480, "ignore_eos": True, "stream": True}) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            os.kill(_device_worker(s), signal.SIGKILL)
            events = [line for line in lines if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]"
        error = json.loads(events[-2][6:])["error"]
        assert error["code"] == "scheduler_unavailable" and error["request_id"]
        assert "Traceback" not in error["message"] and "/" not in error["message"], error
        assert s.proc.wait(30) != 0  # the server exits non-zero when its scheduler dies
    finally:
        s.stop()
    assert "CPU device worker is gone" in s.log()  # the details are in the log, not the answer


# ---------------------------------------------------------------- 8. the API key off the command line


def test_the_api_key_from_a_file(tmp_path):
    """(The key from $BATONLM_API_KEY: the guarded server of test_server_errors.py has it so.)"""
    key_file = tmp_path / "key"
    key_file.write_text("s3cret-key\n")
    s = ServerProcess("--api-key-file", str(key_file))
    try:
        assert b"s3cret" not in open(f"/proc/{s.proc.pid}/cmdline", "rb").read()
        _error(httpx.post(s.base_url + CHAT, json={"messages": MSG}, timeout=30), 401, None)
        ok = httpx.post(s.base_url + CHAT, json={"messages": MSG, "max_tokens": 2},
                        headers={"Authorization": "Bearer s3cret-key"}, timeout=60)
        assert ok.status_code == 200
    finally:
        assert s.stop() == 0


# ---------------------------------------------------------------- timeouts and draining


def test_a_request_past_the_request_timeout_ends_with_an_error():
    """4 choices of 480 tokens run one at a time: at least the later ones wait far longer than
    0.3 s for the first (a step of this engine takes well over 0.1 ms on any machine)."""
    s = ServerProcess("--max-running-requests", "1", "--request-timeout", "0.3")
    try:
        url = s.base_url
        body = {"prompt": "a", "n": 4, "max_tokens": 480, "ignore_eos": True}
        err = _error(httpx.post(url + COMP, json=body, timeout=60), 408, None)
        assert err["code"] == "request_timeout"
        with httpx.Client(timeout=60) as c, c.stream("POST", url + COMP, json={**body, "stream": True}) as st:
            assert st.status_code == 200
            events = [line for line in st.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]" and json.loads(events[-2][6:])["error"]["code"] == "request_timeout"
        wait_until(lambda: metric(url, "batonlm_kv_cache_used_slots") == 0, what="KV freed")
    finally:
        assert s.stop() == 0


def _stream_in_thread(url: str, body: dict, out: dict) -> threading.Thread:
    def run() -> None:
        with httpx.Client(timeout=60) as c, c.stream("POST", url, json=body) as st:
            out["status"] = st.status_code
            out["events"] = [line for line in st.iter_lines() if line.startswith("data: ")]

    t = threading.Thread(target=run)
    t.start()
    return t


def test_sigterm_lets_requests_in_flight_finish_and_exits_0():
    s = ServerProcess("--shutdown-timeout", "60")
    out: dict = {}
    try:
        t = _stream_in_thread(s.base_url + COMP, {"prompt": "a", "max_tokens": 300, "ignore_eos": True,
                                                  "stream": True}, out)
        wait_until(lambda: metric(s.base_url, "batonlm_num_requests_running") == 1, what="the request running")
        s.proc.send_signal(signal.SIGTERM)
        t.join(60)
        assert s.proc.wait(60) == 0
    finally:
        s.stop()
    chunks = [json.loads(e[6:]) for e in out["events"][:-1]]
    assert out["events"][-1] == "data: [DONE]" and chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert "shutting down: 1 request(s) in flight" in s.log()


def test_sigterm_aborts_what_cannot_finish_in_time_with_an_error():
    """4 choices of 480 tokens, one at a time, cannot finish within a 0.2 s drain."""
    s = ServerProcess("--shutdown-timeout", "0.2", "--max-running-requests", "1")
    out: dict = {}
    try:
        url = s.base_url
        t = _stream_in_thread(url + COMP, {"prompt": "a", "n": 4, "max_tokens": 480, "ignore_eos": True,
                                           "stream": True}, out)
        wait_until(lambda: metric(url, "batonlm_num_requests_running") == 1, what="the request running")
        s.proc.send_signal(signal.SIGTERM)
        t.join(60)
        assert s.proc.wait(60) == 0
    finally:
        s.stop()
    assert out["status"] == 200 and out["events"][-1] == "data: [DONE]"
    error = json.loads(out["events"][-2][6:])["error"]
    assert error["code"] == "scheduler_unavailable" and "shutting down" in error["message"]
    with pytest.raises(httpx.TransportError):  # nothing listens any more
        httpx.get(url + "/health", timeout=5)
