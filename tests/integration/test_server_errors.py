"""Bad requests get OpenAI-style 4xx errors naming the problem; the server keeps serving."""

import httpx
import pytest
from live_helpers import metric, wait_until

CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
MSG = [{"role": "user", "content": "Once upon a time"}]

BAD_REQUESTS = [
    # (path, body, expected status, expected param (or None), words in the message)
    (CHAT, {"model": "stories260K"}, 400, "messages", "missing"),
    (CHAT, {"messages": []}, 400, "messages", "at least 1"),
    (CHAT, {"messages": "hello"}, 400, "messages", "list"),
    (CHAT, {"messages": [{"role": "robot", "content": "hi"}]}, 400, "messages.0.role", "user"),
    (CHAT, {"messages": [{"role": "user"}]}, 400, "messages", "needs content"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400,
     "messages.0.content", "only text"),
    (CHAT, {"messages": MSG, "temperature": "hot"}, 400, "temperature", "number"),
    (CHAT, {"messages": MSG, "temperature": -1}, 400, "temperature", "greater than or equal"),
    (CHAT, {"messages": MSG, "top_p": 0}, 400, "top_p", "greater than"),
    (CHAT, {"messages": MSG, "top_k": -2}, 400, "top_k", "greater than or equal to -1"),
    (CHAT, {"messages": MSG, "top_k": 2**63}, 400, "top_k", "less than or equal to 2147483647"),
    (CHAT, {"messages": MSG, "n": 0}, 400, "n", "greater than or equal to 1"),
    (CHAT, {"messages": MSG, "max_tokens": 0}, 400, "max_tokens", "greater than or equal to 1"),
    (CHAT, {"messages": MSG, "max_tokens": "ten"}, 400, "max_tokens", "integer"),
    (CHAT, {"messages": MSG, "max_tokens": 600}, 400, "max_tokens", "512"),
    (CHAT, {"messages": MSG, "frequency_penalty": 3}, 400, "frequency_penalty", "less than or equal to 2"),
    (CHAT, {"messages": MSG, "logit_bias": {"abc": 1}}, 400, "logit_bias", "token ids"),
    (CHAT, {"messages": MSG, "logit_bias": {"\u00b2": 1}}, 400, "logit_bias", "token ids"),  # "²".isdigit()
    (CHAT, {"messages": MSG, "logit_bias": {"99999": 1}}, 400, "logit_bias", "outside the vocabulary"),
    (CHAT, {"messages": MSG, "logit_bias": {"5": 200}}, 400, "logit_bias.5", "less than or equal to 100"),
    (CHAT, {"messages": MSG, "stop_token_ids": [70000]}, 400, "stop_token_ids", "outside the vocabulary"),
    (CHAT, {"messages": MSG, "top_logprobs": 3}, 400, "top_logprobs", "logprobs"),
    (CHAT, {"messages": MSG, "logprobs": True, "top_logprobs": 50}, 400, "top_logprobs", "at most 20"),
    (CHAT, {"messages": MSG, "tools": [{"type": "function"}]}, 400, "tools.0.function", "Missing"),
    (CHAT, {"messages": MSG, "tools": [{"type": "function", "function": {"name": "f"}}],
            "tool_choice": {"type": "function", "function": {"name": "g"}}}, 400, "tool_choice", "names no tool"),
    (CHAT, {"messages": MSG, "stream_options": {"include_usage": True}}, 400, "stream_options", "stream"),
    (CHAT, {"messages": MSG, "stream": "yes"}, 400, "stream", "boolean"),
    (CHAT, {"messages": MSG, "min_tokens": 50, "max_tokens": 10}, 400, "min_tokens", "exceeds"),
    (CHAT, {"messages": MSG, "stop": ""}, 400, "stop", "empty"),
    (COMP, {"prompt": []}, 400, "prompt", "empty"),
    (COMP, {"prompt": 5}, 400, "prompt", None),
    (COMP, {"prompt": [[1, 2], []]}, 400, "prompt", "empty"),
    (COMP, {"prompt": [1, 99999]}, 400, "prompt", "outside the vocabulary"),
    (COMP, {"prompt": "x " * 600}, 400, "prompt", "512"),
    (COMP, {"prompt": "hi", "suffix": "there"}, 400, "suffix", None),
    (COMP, {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens", "only with echo"),
    (COMP, {"prompt": "hi", "max_tokens": -1, "echo": True}, 400, "max_tokens", "greater than or equal to 0"),
    (COMP, {"prompt": "hi", "echo": True, "logprobs": 21}, 400, "logprobs", "at most 20"),
    (COMP, {"prompt": "hi", "best_of": 2}, 400, "best_of", "Unrecognized"),
    ("/generate", {"text": "hi", "input_ids": [1]}, 400, None, "exactly one"),
    ("/generate", {"text": "hi", "sampling_params": {"temprature": 1}}, 400, "sampling_params.temprature", "unknown"),
    ("/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 0}}, 400, "sampling_params.max_new_tokens", None),
    ("/generate", {"input_ids": [1, 2], "return_logprob": True, "logprob_start_len": 3}, 400, "logprob_start_len",
     "at most the prompt's length (2 tokens)"),
    ("/generate", {"input_ids": [1, 2], "return_logprob": True, "logprob_start_len": -2}, 400, "logprob_start_len",
     "greater than or equal to -1"),
    ("/generate", {"input_ids": [1, 2], "return_logprob": True, "top_logprobs_num": 21}, 400, "top_logprobs_num", None),
    ("/generate", {"input_ids": [1, 2], "sampling_params": {"prompt_logprobs": 0, "logprob_start_len": 5}}, 400,
     "sampling_params.logprob_start_len", "at most the prompt's length"),
    ("/generate", {"input_ids": [1, 2], "sampling_params": {"logprob_start_len": 1}}, 400,
     "sampling_params.logprob_start_len", "needs prompt_logprobs"),
]


def _check_error(r: httpx.Response, status: int, param, words) -> None:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code", "request_id"}
    assert err["message"] and err["type"]
    assert err["request_id"] == r.headers["x-request-id"]  # what to quote when reporting it
    assert "Traceback" not in r.text and "/batonlm/" not in r.text
    if param is not None:
        assert err["param"] == param, err
    if words is not None:
        assert words.lower() in err["message"].lower(), err


@pytest.mark.parametrize("path, body, status, param, words", BAD_REQUESTS, ids=lambda x: None)
def test_bad_request_gets_an_openai_error(server, path, body, status, param, words):
    r = httpx.post(server.base_url + path, json=body, timeout=30)
    _check_error(r, status, param, words)


def test_malformed_requests(server):
    for raw in (b"{not json", b"[1, 2]", b"", "\u00e9".encode("latin-1")):
        r = httpx.post(server.base_url + CHAT, content=raw, headers={"content-type": "application/json"}, timeout=30)
        _check_error(r, 400, None, None)
    _check_error(httpx.get(server.base_url + "/v1/nothing", timeout=30), 404, None, None)
    not_allowed = httpx.get(server.base_url + CHAT, timeout=30)
    _check_error(not_allowed, 405, None, None)
    assert not_allowed.headers["allow"] == "POST"
    _check_error(httpx.get(server.base_url + "/v1/models/gpt-17", timeout=30), 404, "model", "does not exist")


def test_server_still_serves_after_bad_requests(server):
    for path, body, *_ in BAD_REQUESTS:
        httpx.post(server.base_url + path, json=body, timeout=30)
    r = httpx.post(server.base_url + CHAT, json={"messages": MSG, "max_tokens": 8, "temperature": 0}, timeout=30)
    assert r.status_code == 200
    assert r.json()["choices"][0]["message"]["content"].startswith(", there was a little")
    assert httpx.get(server.base_url + "/health", timeout=30).status_code == 200


def test_api_key_and_request_size(guarded_server):
    url = guarded_server.base_url
    assert b"sekrit" not in open(f"/proc/{guarded_server.proc.pid}/cmdline", "rb").read()  # from the environment
    _check_error(httpx.post(url + CHAT, json={"messages": MSG}, timeout=30), 401, None, "api key")
    bad_key = {"Authorization": "Bearer nope"}
    _check_error(httpx.post(url + CHAT, json={"messages": MSG}, headers=bad_key, timeout=30), 401, None, None)
    auth = {"Authorization": "Bearer sekrit"}
    ok = httpx.post(url + CHAT, json={"messages": MSG, "max_tokens": 3}, headers=auth, timeout=30)
    assert ok.status_code == 200
    assert httpx.get(url + "/health", timeout=30).status_code == 200  # health needs no key
    for path in ("/version", "/metrics", "/openapi.json"):  # probes and descriptions are open (metrics: by default)
        assert httpx.get(url + path, timeout=30).status_code == 200, path
    # Every route that does work needs the key, the tokenizer's too (a 4 MiB /tokenize was a
    # free 3 s stall); a route that does not exist answers 401 before 404, as OpenAI's does.
    for method, path, body in [("POST", "/tokenize", {"prompt": "Once"}), ("POST", "/detokenize", {"tokens": [1]}),
                               ("GET", "/tokenizer_info", None), ("POST", "/flush_cache", None),
                               ("GET", "/v1/models", None), ("POST", "/generate", {"text": "Once"}),
                               ("GET", "/no/such/route", None)]:
        _check_error(httpx.request(method, url + path, json=body, timeout=30), 401, None, None)
    assert httpx.post(url + "/tokenize", json={"prompt": "Once"}, headers=auth, timeout=30).status_code == 200
    big = {"messages": [{"role": "user", "content": "x" * 5000}]}
    _check_error(httpx.post(url + CHAT, json=big, headers=auth, timeout=30), 413, None, "2000")


def test_whole_answers_stay_within_the_response_budget(guarded_server):
    """--max-response-bytes 8192 (512 values at 16 bytes): refused before it runs when the tokens
    are certain (ignore_eos), ended when the answer grows past it; the same request streams."""
    url, auth = guarded_server.base_url, {"Authorization": "Bearer sekrit"}
    body = {"prompt": "Once upon a time", "max_tokens": 200, "n": 4, "logprobs": 5, "temperature": 0}
    r = httpx.post(url + "/v1/completions", json={**body, "ignore_eos": True}, headers=auth, timeout=60)
    _check_error(r, 400, "logprobs", "max-response-bytes")
    assert r.json()["error"]["code"] == "response_too_large"
    r = httpx.post(url + "/v1/completions", json=body, headers=auth, timeout=60)
    _check_error(r, 400, "logprobs", "grew past")  # greedy: the story runs past 16 tokens (512 / 4 choices / 8)
    r = httpx.post(url + "/v1/chat/completions", json={"messages": MSG, "max_tokens": 100, "n": 8, "ignore_eos": True},
                   headers=auth, timeout=60)
    _check_error(r, 400, "max_tokens", "max-response-bytes")
    r = httpx.post(url + "/v1/completions", json={**body, "stream": True}, headers=auth, timeout=60)
    assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]") and '"error"' not in r.text
    small = httpx.post(url + "/v1/completions", json={"prompt": "Once", "max_tokens": 8}, headers=auth, timeout=60)
    assert small.status_code == 200, small.text
    wait_until(lambda: metric(url, "batonlm_num_requests_running") == 0, what="the ended choices aborted")
