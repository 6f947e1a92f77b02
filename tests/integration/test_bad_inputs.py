"""The bad-input corpus (tests/bad_inputs.py): every case gets its 4xx naming the field, the
server stays healthy, and a stream running meanwhile is unaffected (token for token)."""

from __future__ import annotations

import json
import threading

import httpx
from bad_inputs import COMP, CORPUS, MSGS, ROUTES

STREAM = {"prompt": "Once upon a time", "max_tokens": 300, "temperature": 0, "ignore_eos": True, "stream": True}


def _stream_text(url: str) -> str:
    with httpx.Client(timeout=120) as c, c.stream("POST", url + COMP, json=STREAM) as r:
        assert r.status_code == 200
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    return "".join(ch["choices"][0]["text"] for ch in chunks)


def _send(url: str, path: str, body) -> httpx.Response:
    if isinstance(body, bytes):
        return httpx.post(url + path, content=body, headers={"content-type": "application/json"}, timeout=60)
    return httpx.post(url + path, json=body, timeout=60)


def test_the_corpus_covers_the_generation_routes():
    per_route = {p: sum(1 for c in CORPUS if c[0] == p) for p in ROUTES}
    assert len(CORPUS) >= 60 and min(per_route.values()) >= 15, per_route


def test_every_bad_input_gets_its_4xx_while_a_stream_runs_unaffected(server):
    url = server.base_url
    expected = _stream_text(url)  # the same greedy stream, alone
    got: dict = {}
    t = threading.Thread(target=lambda: got.setdefault("text", _stream_text(url)))
    t.start()
    failures = []
    for path, body, status, param, words in CORPUS:
        r = _send(url, path, body)
        label = f"{path} {str(body)[:80]}"
        if r.status_code != status:
            failures.append(f"{label}: {r.status_code} {r.text[:200]}")
            continue
        err = r.json()["error"]
        if path == MSGS:  # Anthropic's shape: the request id beside the error, the field in its message
            kind = {400: "invalid_request_error", 404: "not_found_error"}[status]
            if r.json()["type"] != "error" or err["type"] != kind:
                failures.append(f"{label}: not Anthropic's error shape: {r.text[:200]}")
            err = {**err, "request_id": r.json().get("request_id"),
                   "param": param if param is None or param in err["message"] else err["message"]}
        if err["request_id"] != r.headers["x-request-id"] or not err["message"]:
            failures.append(f"{label}: {err}")
        if param is not None and err["param"] != param:
            failures.append(f"{label}: param {err['param']!r}, wanted {param!r}")
        if words is not None and words.lower() not in err["message"].lower():
            failures.append(f"{label}: {err['message']!r} lacks {words!r}")
        if "Traceback" in r.text or 'File "' in r.text:
            failures.append(f"{label}: a traceback in the answer")
    t.join(120)
    assert not failures, "\n".join(failures)
    assert got["text"] == expected  # the stream saw nothing of the storm
    assert httpx.get(url + "/health", timeout=30).status_code == 200
