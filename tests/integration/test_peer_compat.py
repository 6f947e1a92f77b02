"""What the peers' own server test suites (vLLM's, SGLang's, llama.cpp's) and OpenAI's API check, on
points where batonlm once differed: legacy logprobs carry the sampled token, a completion
stream's last token chunk carries the finish reason, /generate takes SGLang's `n` and batched
prompts."""

import httpx
import openai

COMP, GEN = "/v1/completions", "/generate"


def test_legacy_logprobs_always_include_the_sampled_token(client):
    # logprobs 0: just the sampled token (OpenAI: "up to logprobs + 1 elements").
    r = client.completions.create(model="stories260K", prompt="Once upon a time", max_tokens=6, logprobs=0,
                                  temperature=0)
    lp = r.choices[0].logprobs
    assert [len(t) for t in lp.top_logprobs] == [1] * 6
    for token, token_lp, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert top == {token: token_lp}
    # Sampled at a high temperature, the chosen token is often not among the 2 best: it is there anyway.
    r = client.completions.create(model="stories260K", prompt="Once upon a time", max_tokens=40, logprobs=2,
                                  temperature=2.0, seed=7)
    lp = r.choices[0].logprobs
    outside = 0
    for token, token_lp, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert top[token] == token_lp and 2 <= len(top) <= 3
        outside += len(top) == 3
    assert outside > 0, "no sampled token fell outside the top 2: the check saw nothing"


def test_a_completion_stream_ends_on_its_last_token_chunk(client):
    for max_tokens in (1, 5):
        chunks = list(client.completions.create(model="stories260K", prompt="Once upon a time", max_tokens=max_tokens,
                                                temperature=0, stream=True))
        texts = [c.choices[0].text for c in chunks]
        finishes = [c.choices[0].finish_reason for c in chunks]
        assert len(chunks) <= max_tokens
        assert finishes[-1] == "length" and all(f is None for f in finishes[:-1])
        assert texts[-1] != ""
    # Several choices: each one's last chunk carries its reason; none is an empty text after it.
    chunks = list(client.completions.create(model="stories260K", prompt="Once upon a time", max_tokens=4, n=3,
                                            temperature=1.0, seed=1, stream=True))
    by_choice: dict[int, list] = {}
    for c in chunks:
        by_choice.setdefault(c.choices[0].index, []).append(c.choices[0])
    assert sorted(by_choice) == [0, 1, 2]
    for parts in by_choice.values():
        assert len(parts) <= 4 and parts[-1].finish_reason == "length" and parts[-1].text
        assert all(p.finish_reason is None for p in parts[:-1])
    # A stop string: the chunk that ends it says "stop".
    chunks = list(client.completions.create(model="stories260K", prompt="Once upon a time", max_tokens=30,
                                            temperature=0, stop=["girl"], stream=True))
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert "".join(c.choices[0].text for c in chunks) == ", there was a little "


def test_openai_client_logprobs_echo_types(server):
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0)
    r = client.completions.create(model="stories260K", prompt="Once upon a time", max_tokens=0, echo=True, logprobs=1)
    lp = r.choices[0].logprobs
    assert lp.top_logprobs[0] is None and lp.token_logprobs[0] is None  # nothing precedes the first token
    for token, token_lp, top in zip(lp.tokens[1:], lp.token_logprobs[1:], lp.top_logprobs[1:]):
        assert top[token] == token_lp and 1 <= len(top) <= 2


def test_generate_takes_sglang_n_and_batched_prompts(server):
    url = server.base_url + GEN
    greedy = {"max_new_tokens": 8, "temperature": 0}
    one = httpx.post(url, json={"text": "Once upon a time", "sampling_params": greedy}, timeout=60).json()
    # A list of prompts: a list of answers, in order.
    many = httpx.post(url, json={"text": ["Once upon a time", "Lily saw"], "sampling_params": greedy}, timeout=60).json()
    assert isinstance(many, list) and len(many) == 2
    assert many[0]["text"] == one["text"]
    other = httpx.post(url, json={"text": "Lily saw", "sampling_params": greedy}, timeout=60).json()
    assert many[1]["text"] == other["text"]
    ids = httpx.post(url, json={"input_ids": [[1, 403, 407], [1, 403]], "sampling_params": greedy}, timeout=60).json()
    assert [len(a["output_ids"]) for a in ids] == [8, 8]
    # n: n answers per prompt (prompt-major), sampled with the request's seed.
    sampled = {"max_new_tokens": 8, "temperature": 1.0, "n": 3, "seed": 5}
    n3 = httpx.post(url, json={"text": "Once upon a time", "sampling_params": sampled}, timeout=60).json()
    assert isinstance(n3, list) and len(n3) == 3
    assert len({a["text"] for a in n3}) > 1, "n choices should differ when sampled"
    both = httpx.post(url, json={"text": ["Once upon a time", "Lily saw"], "sampling_params": sampled},
                      timeout=60).json()
    assert len(both) == 6 and [a["text"] for a in both[:3]] == [a["text"] for a in n3]
    # Streamed: each event names its choice (`index`), each choice ends once.
    with httpx.stream("POST", url, json={"text": ["Once", "Lily"], "sampling_params": {**greedy, "n": 2},
                                         "stream": True}, timeout=60) as st:
        events = [line[6:] for line in st.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    import json

    finished = [json.loads(e)["index"] for e in events[:-1] if json.loads(e)["meta_info"]["finish_reason"]]
    assert sorted(finished) == [0, 1, 2, 3]
    bad = httpx.post(url, json={"text": ["a"] * 300}, timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "text"
    bad = httpx.post(url, json={"text": "a", "sampling_params": {"n": 17}}, timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "sampling_params.n"


def test_the_healthcheck_probes_the_port_the_server_was_started_with(server):
    """The Docker image's HEALTHCHECK (`batonlm healthcheck`) reads the port from the server's own
    command line, so `docker run IMAGE MODEL --port 8000` is probed on 8000."""
    import subprocess
    import sys

    from batonlm.cli import serving_port

    assert serving_port(server.proc.pid) == ("127.0.0.1", server.port)
    ok = subprocess.run([sys.executable, "-m", "batonlm", "healthcheck", "--pid", str(server.proc.pid)], timeout=60)
    assert ok.returncode == 0
    from batonlm.bench.server_process import free_port

    down = subprocess.run([sys.executable, "-m", "batonlm", "healthcheck", "--port", str(free_port())],
                          capture_output=True, text=True, timeout=60)
    assert down.returncode == 1 and "/health" in down.stderr
