"""The surfaces added after the first hostile-client probe (constraints, tools, logprobs), probed
again (issue 23): a test per defect, against the session server."""

from __future__ import annotations

import json
import math

import httpx
import pytest

CHAT, COMP = "/v1/chat/completions", "/v1/completions"
MSG = [{"role": "user", "content": "Once upon a time"}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}
FLOOR = -9999.0  # OpenAI's and vLLM's logprob for a token that cannot be drawn


def _logprob_numbers(node):
    """Every logprob value in an answer, wherever its shape keeps it: chat's `logprob` entries,
    the legacy `token_logprobs` list and `top_logprobs` maps (text -> logprob)."""
    if isinstance(node, list):
        for v in node:
            yield from _logprob_numbers(v)
    elif isinstance(node, dict):
        for k, v in node.items():
            if k == "logprob":
                yield v
            elif k == "token_logprobs":
                yield from v
            elif k == "top_logprobs" and isinstance(v, list) and v and isinstance(v[0], dict) and "logprob" not in v[0]:
                yield from (x for m in v if m is not None for x in m.values())  # legacy maps
            else:
                yield from _logprob_numbers(v)


# (route, body) pairs that answered 500 ("Out of range float values are not JSON compliant":
# the -inf logprob of a token the constraint masks) or streamed `"logprob": null`.
MASKED_LOGPROBS = [
    (COMP, {"prompt": "Once", "max_tokens": 4, "regex": "(yes|no)", "logprobs": 5}),
    (CHAT, {"messages": MSG, "max_tokens": 8, "response_format": {"type": "json_object"}, "logprobs": True,
            "top_logprobs": 2}),
    (CHAT, {"messages": MSG, "max_tokens": 24, "tools": [TOOL], "tool_choice": "required", "logprobs": True,
            "top_logprobs": 3}),
    (COMP, {"prompt": "Once", "max_tokens": 4, "temperature": 1e-45, "logprobs": 3}),
]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize(("path", "body"), MASKED_LOGPROBS, ids=["regex", "json_object", "tool_required", "tiny_temp"])
def test_logprobs_of_tokens_that_cannot_be_drawn_are_numbers(server, path, body, stream):
    r = httpx.post(server.base_url + path, json={**body, "stream": stream}, timeout=60)
    assert r.status_code == 200, r.text
    if stream:
        answers = [json.loads(line[6:]) for line in r.text.splitlines()
                   if line.startswith("data: ") and line != "data: [DONE]"]
    else:
        answers = [r.json()]
    values = [v for a in answers for v in _logprob_numbers(a["choices"])]
    assert values, answers  # the answer does carry logprobs
    for v in values:
        assert isinstance(v, float | int) and not isinstance(v, bool) and math.isfinite(v) and FLOOR <= v <= 0, v
    if "regex" in body:  # after "y" only "es" can follow: the other alternatives are masked
        assert FLOOR in values


def test_a_tiny_temperature_draws_what_greedy_draws(server):
    """temperature 1e-45 divided the logits into infinities (NaN probabilities); it is greedy."""
    def text(temperature: float) -> str:
        r = httpx.post(server.base_url + COMP, json={"prompt": "Once", "max_tokens": 12, "temperature": temperature},
                       timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]

    assert text(1e-45) == text(0.0) == text(1e-6)


# ---------------------------------------------------------------- 1. a frontend that does not read


def test_a_frontend_that_stops_reading_pauses_decoding_and_loses_nothing():
    """SIGSTOP of the main process (what a long GC pause, swap or a debugger do) while 8 streams
    decode one at a time: the scheduler's outputs fill the socket, its send used to time out after
    1 s and the scheduler exited. Now decoding pauses until the frontend reads, and every stream
    completes."""
    import os
    import signal
    import threading

    from live_helpers import metric, wait_until

    from batonlm.bench.server_process import ServerProcess

    streams, max_tokens = 8, 480  # 3,840 iterations of one request: more outputs than the socket holds
    s = ServerProcess("--max-running-requests", "1", "--compile", "off")
    try:
        done: list[int] = []

        def stream() -> None:
            body = {"prompt": "Once", "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
                    "stream_options": {"include_usage": True}}
            with httpx.stream("POST", s.base_url + COMP, json=body, timeout=600) as r:
                events = [json.loads(line[6:]) for line in r.iter_lines()
                          if line.startswith("data: ") and line != "data: [DONE]"]
            assert not any("error" in e for e in events), events[-1]
            done.append(events[-1]["usage"]["completion_tokens"])

        threads = [threading.Thread(target=stream, daemon=True) for _ in range(streams)]
        for t in threads:
            t.start()
        in_server = lambda: metric(s.base_url, "batonlm_num_requests_running") + metric(  # noqa: E731
            s.base_url, "batonlm_num_requests_waiting")
        wait_until(lambda: in_server() == streams, timeout=60, what="every stream admitted")
        os.kill(s.proc.pid, signal.SIGSTOP)
        try:
            wait_until(lambda: "decoding paused" in s.log(), timeout=300, what="the scheduler to pause")
        finally:
            os.kill(s.proc.pid, signal.SIGCONT)
        for t in threads:
            t.join(600)
        assert done == [max_tokens] * streams, done
        assert "decoding resumed" in s.log()
        assert s.proc.poll() is None and httpx.get(s.base_url + "/health", timeout=30).status_code == 200
    finally:
        assert s.stop() == 0, s.log()


# ---------------------------------------------------------------- 3, 8. heavy or hostile fields


def test_a_request_far_beyond_a_limit_costs_no_parsing(server):
    """20,000 tools (1 MB): the uniqueness check was quadratic and the tool schemas were all
    validated on the event loop (11.9 s for everyone); the raw body's count is refused first."""
    tools = [{"type": "function", "function": {"name": f"f{i}", "parameters": {"type": "object"}}}
             for i in range(20_000)]
    r = httpx.post(server.base_url + CHAT, json={"messages": MSG, "tools": tools}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools", r.text
    assert "at most 128 tools" in r.json()["error"]["message"]
    dup = [TOOL, TOOL]
    r = httpx.post(server.base_url + CHAT, json={"messages": MSG, "tools": dup}, timeout=60)
    assert r.status_code == 400 and "two tools are named 'f'" in r.text, r.text


@pytest.mark.parametrize("rid", ["a\nforged log line", "tab\there", "", "x" * 257])
def test_a_request_id_is_visible_ascii(server, rid):
    r = httpx.post(server.base_url + "/generate", json={"text": "Once", "rid": rid}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "rid", r.text


def test_grammar_errors_carry_no_backend_internals(server):
    """minLength -5 fails in xgrammar's compile, whose message began "[13:04:34] /project/cpp/...cc:1563: "."""
    schema = {"type": "object", "properties": {"a": {"type": "string", "minLength": -5}}}
    r = httpx.post(server.base_url + COMP, json={"prompt": "Once", "max_tokens": 8, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}, timeout=60)
    assert ".cc" not in r.text and "/project" not in r.text and "cpp" not in r.text, r.text
    assert r.status_code == 400 or "error" in r.text, r.text


def test_a_whole_answer_that_surely_exceeds_the_budget_is_refused_before_it_runs(server):
    """Echoed prompt logprobs are certain: 512 choices x 500 prompt tokens x 22 values (OOMed the
    frontend past 6 GB from a 307 KB request). Streamed, the same request is not bounded."""
    body = {"prompt": [list(range(3, 503))] * 32, "n": 16, "echo": True, "logprobs": 20, "max_tokens": 1}
    r = httpx.post(server.base_url + COMP, json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "logprobs" and err["code"] == "response_too_large", err


@pytest.mark.parametrize(("kind", "text"), [("regex", "[^\\s\\S]"), ("ebnf", "root ::= root")])
def test_a_constraint_whose_language_is_empty_is_an_error_not_unk_tokens(server, kind, text):
    """Every token masked: sampling drew token 0 (<unk>) until max_tokens, one ERROR line each."""
    body = {"prompt": "Once", "max_tokens": 4, kind: text}
    r = httpx.post(server.base_url + COMP, json=body, timeout=60)
    assert r.status_code == 400 and "admits no text" in r.json()["error"]["message"], r.text
    assert r.json()["error"]["param"] == kind, r.text  # the scheduler's refusal names the field (was null)
    r = httpx.post(server.base_url + COMP, json={**body, "stream": True}, timeout=60)  # an error event, not "abort"
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    assert "admits no text" in events[-1]["error"]["message"] and events[-1]["error"]["param"] == kind, r.text


# After "a" the grammar needs an x, and every x needs an x before it: no token can follow "a".
DEAD_END = 'root ::= "a" x\nx ::= x "b"'


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_grammar_that_dead_ends_mid_output_ends_the_request_with_an_error(server, temperature):
    """Its first token fits, then every token is masked: the sampler's pick (token 0, <unk>) went
    out as output until max_tokens, an ERROR log line each, and the answer said finish "length".
    Now the request ends there with a 400 (streamed: an error event after the "a") naming the
    field, on completions and chat, and the server goes on serving."""
    body = {"prompt": "Once", "max_tokens": 6, "ebnf": DEAD_END, "temperature": temperature}
    r = httpx.post(server.base_url + COMP, json=body, timeout=60)
    err = r.json()["error"]
    assert r.status_code == 400 and "dead end" in err["message"] and err["param"] == "ebnf", r.text
    r = httpx.post(server.base_url + COMP, json={**body, "stream": True}, timeout=60)
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == "a", r.text
    assert "dead end" in events[-1]["error"]["message"] and events[-1]["error"]["param"] == "ebnf", r.text
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "ebnf": DEAD_END}
    r = httpx.post(server.base_url + "/v1/chat/completions", json=chat, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "ebnf", r.text
    r = httpx.post(server.base_url + COMP, json={"prompt": "Once", "max_tokens": 4, "regex": "(yes|no)!"}, timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] in ("yes!", "no!"), r.text


# ---------------------------------------------------------------- 5. liveness that means progress


@pytest.mark.parametrize("target", ["scheduler", "device worker", "DP replica"])  # a stopped TP rank: test_tp_server.py
def test_a_stopped_process_is_seen_and_the_server_exits(target):
    """SIGSTOP of the scheduler or its device worker while a stream runs: /health said 200 and
    the client waited for ever. Now the watchdog (--watchdog-timeout 2) ends the stream with an
    error event, and the server exits 1, leaving no process behind. With --dp 2, one replica's
    scheduler stopped: its stream ends with the watchdog's error, the other replica's finishes
    (or ends with the server's going down), and nothing of either replica is left."""
    import os
    import signal
    import threading
    import time

    from live_helpers import wait_until

    from batonlm.bench.server_process import ServerProcess
    from batonlm.process_tree import children

    dp = target == "DP replica"
    s = ServerProcess("--compile", "off", "--watchdog-timeout", "2", *(("--dp", "2") if dp else ()))
    try:
        schedulers = [p for p in children(s.proc.pid) if "resource_tracker" not in open(f"/proc/{p}/cmdline").read()]
        assert len(schedulers) == (2 if dp else 1), schedulers
        victim = schedulers[0] if target != "device worker" else children(schedulers[0])[0]
        everyone = s.descendants()
        streams: list[list[dict]] = [[] for _ in range(2 if dp else 1)]  # one per replica (the router balances)

        def stream(events: list[dict]) -> None:
            body = {"prompt": "Once", "max_tokens": 480, "ignore_eos": True, "stream": True}
            with httpx.stream("POST", s.base_url + COMP, json=body, timeout=60) as r:
                events.extend(json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {"))

        threads = [threading.Thread(target=stream, args=(events,), daemon=True) for events in streams]
        for t in threads:
            t.start()
        wait_until(lambda: all(len(events) > 2 for events in streams), what="the streams started")
        os.kill(victim, signal.SIGSTOP)
        t0 = time.monotonic()
        for t in threads:
            t.join(30)
        # Each ended with an error event, or (the other replica's, 480 tokens in about a second)
        # had finished before the watchdog's 2 s were up.
        assert all("error" in events[-1] or events[-1]["choices"][0]["finish_reason"] == "length"
                   for events in streams), [events[-1] for events in streams]
        assert any("stuck" in events[-1].get("error", {}).get("message", "") for events in streams), [
            e[-1] for e in streams]
        s.proc.wait(15)
        assert s.proc.returncode == 1 and time.monotonic() - t0 < 12, s.log()
        assert "finished no iteration" in s.log()

        def left() -> list[int]:
            return [p for p in everyone if os.path.exists(f"/proc/{p}") and "zombie" not in
                    open(f"/proc/{p}/status").read()]
        wait_until(lambda: not left(), timeout=10, what="every process gone")
    finally:
        s.stop()
