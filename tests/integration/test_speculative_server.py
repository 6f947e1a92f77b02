"""`batonlm serve --speculative-algorithm ngram` as a user drives it: exact greedy text, a stop
string in the middle of accepted drafts, per-request counts in /generate's meta_info, the
server-wide ones in /metrics."""

from __future__ import annotations

import json

import httpx
import pytest
from helpers import build_byte_cycle_model, copy_tokenizer
from prometheus_client.parser import text_string_to_metric_families

from batonlm.bench.server_process import ServerProcess

CYCLE_TEXT = "abcdefghijklmnopqrstuvwxyz0123456789"


@pytest.fixture(scope="module", params=["ngram", "draft"])
def spec_server(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("cycle_server") / "model"
    cycle = build_byte_cycle_model(path, CYCLE_TEXT)
    copy_tokenizer(path)
    algorithm = ["--speculative-algorithm", request.param]
    if request.param == "draft":  # the model as its own draft: drafts are right
        algorithm += ["--speculative-draft-model", str(path)]
    # Cost ratio 0: a draft whenever there is one (the measured gate depends on timing).
    s = ServerProcess(str(path), *algorithm, "--speculative-num-draft-tokens", "5", "--speculative-cost-ratio", "0")
    yield s, cycle
    assert s.stop() == 0, s.log()


def test_greedy_text_stop_strings_and_counts(spec_server):
    server, cycle = spec_server
    url = server.base_url
    prompt = [1, *cycle, *cycle[:3]]  # the whole cycle once: drafts match from the first step
    r = httpx.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": 100, "temperature": 0}, timeout=60)
    text = r.json()["choices"][0]["text"]
    assert text == (CYCLE_TEXT * 4)[3:103] and r.json()["usage"]["completion_tokens"] == 100
    # A stop string: the text ends before it, the request ends there (its tokens were accepted
    # drafts of one verification step, past it nothing reaches the client).
    for stream in (False, True):
        body = {"prompt": prompt, "max_tokens": 100, "temperature": 0, "stop": ["mno"], "stream": stream}
        if stream:
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as resp:
                events = [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]
            chunks = [json.loads(e) for e in events if e != "[DONE]"]
            got = "".join(c["choices"][0]["text"] for c in chunks)
            finish = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"][0]["finish_reason"]]
        else:
            out = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()["choices"][0]
            got, finish = out["text"], [out["finish_reason"]]
        assert got == "defghijkl" and finish == ["stop"]
    meta = httpx.post(f"{url}/generate", json={"input_ids": prompt, "sampling_params": {
        "max_new_tokens": 60, "temperature": 0}}, timeout=60).json()["meta_info"]
    assert meta["completion_tokens"] == 60 and meta["spec_verify_ct"] > 0
    assert meta["spec_accept_length"] == (meta["spec_verify_ct"] + meta["spec_accepted_drafts"]) / meta["spec_verify_ct"]
    metrics = httpx.get(f"{url}/metrics", timeout=30).text
    samples = {s.name: s for fam in text_string_to_metric_families(metrics) for s in fam.samples}
    steps = samples["batonlm_spec_verify_steps"].value
    assert steps >= meta["spec_verify_ct"] and samples["batonlm_spec_accepted_tokens"].value > 0
    by_accepted = [s for fam in text_string_to_metric_families(metrics) for s in fam.samples
                   if s.name == "batonlm_spec_verify_steps_by_accepted"]
    assert len(by_accepted) == 6 and sum(s.value for s in by_accepted) == steps
