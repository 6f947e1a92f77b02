"""The official openai client against a live server on the embedded story model."""

import math
import shutil
import subprocess

import openai
import pytest

MODEL = "stories260K"
LILY = ", there was a little girl named Lily. She loved to play outside in the park."
STORY_END = (
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the park. One day,"
    " she saw a big, red ball. She wanted to play with it, but it was too high. Lily asked her mom for help."
    " Her mom smiled and lifted her up. Lily got the ball and they played together all day. The end."
)


def test_models(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError) as err:
        client.models.retrieve("gpt-17")
    assert err.value.body["code"] == "model_not_found"


def test_unknown_model_in_a_request_is_not_found(client):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-17", prompt="Once upon a time", max_tokens=3)


def test_completion_greedy_length_and_usage(client):
    r = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=30, temperature=0)
    assert r.choices[0].text.startswith(LILY)
    assert r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (5, 30, 35)


def test_completion_eos_gives_stop(client):
    r = client.completions.create(model=MODEL, prompt=STORY_END, max_tokens=50, temperature=0)
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens < 50


def test_chat_completion(client):
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Once upon a time"}], max_tokens=30, temperature=0
    )
    msg = r.choices[0].message
    assert msg.role == "assistant" and msg.content.startswith(LILY)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 30
    # The built-in template: BOS + the message text.
    assert r.usage.prompt_tokens == 5


def test_chat_stream_with_usage(client):
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Once upon a time"}], max_tokens=20, temperature=0,
        stream=True, stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
    assert all(c.usage is None for c in chunks[:-1])
    full = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Once upon a time"}], max_tokens=20, temperature=0
    )
    assert text == full.choices[0].message.content


def test_completion_stream(client):
    stream = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=15, temperature=0, stream=True)
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks)
    assert text == client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=15, temperature=0).choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_n_choices(client):
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Lily"}], max_tokens=12, n=2, seed=7, temperature=1.0
    )
    assert [c.index for c in r.choices] == [0, 1]
    assert r.choices[0].message.content != r.choices[1].message.content
    assert r.usage.completion_tokens == 24
    stream = client.completions.create(model=MODEL, prompt="Lily", max_tokens=8, n=2, seed=7, stream=True)
    finished = {c.choices[0].index for c in stream if c.choices[0].finish_reason}
    assert finished == {0, 1}


def test_list_and_token_id_prompts(client):
    r = client.completions.create(model=MODEL, prompt=["Once upon a time", "Lily"], max_tokens=5, temperature=0)
    assert len(r.choices) == 2 and r.usage.prompt_tokens == 5 + 2
    ids = client.completions.create(model=MODEL, prompt=[1, 403, 407, 261, 378], max_tokens=5, temperature=0)
    assert ids.choices[0].text == r.choices[0].text
    both = client.completions.create(model=MODEL, prompt=[[1, 403, 407, 261, 378], [1, 403]], max_tokens=5, temperature=0)
    assert both.choices[0].text == r.choices[0].text and len(both.choices) == 2


def test_stop_strings_trimmed(client):
    r = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=40, temperature=0, stop=["named Lily"])
    assert r.choices[0].text == ", there was a little girl "
    assert r.choices[0].finish_reason == "stop"
    # A stop string spanning several tokens (" g", "ir", "l"), streamed.
    stream = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=40, temperature=0,
                                       stop=["girl", "nothing"], stream=True)
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks) == ", there was a little "
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_stop_token_ids(client):
    ref = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=20, temperature=0)
    r = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=20, temperature=0,
                                  extra_body={"stop_token_ids": [426]})  # the "." after "Lily"
    assert r.choices[0].finish_reason == "stop"
    assert ref.choices[0].text.startswith(r.choices[0].text) and len(r.choices[0].text) < len(ref.choices[0].text)
    assert r.choices[0].text.endswith("Lily.")


def test_same_seed_same_text(client):
    def run(seed):
        return client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Tom"}], max_tokens=25, seed=seed, temperature=1.0
        ).choices[0].message.content

    a, b, c = run(123), run(123), run(124)
    assert a == b and a != c


def test_echo(client):
    r = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=0, echo=True)
    assert r.choices[0].text.startswith("Once upon a time, there was")


def test_chat_logprobs(client):
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Once upon a time"}], max_tokens=6, temperature=0,
        logprobs=True, top_logprobs=3,
    )
    content = r.choices[0].logprobs.content
    assert len(content) == 6
    assert "".join(t.token for t in content) == r.choices[0].message.content
    for t in content:
        assert t.logprob <= 0 and len(t.top_logprobs) == 3
        # Greedy: the chosen token is the most likely one.
        assert t.top_logprobs[0].token == t.token and math.isclose(t.top_logprobs[0].logprob, t.logprob, abs_tol=1e-5)
        assert t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob >= t.top_logprobs[2].logprob
        assert bytes(t.bytes).decode() == t.token
    assert sum(math.exp(x.logprob) for x in content[0].top_logprobs) <= 1.0 + 1e-5


def test_completion_logprobs_match_transformers(client, stories_path):
    import torch
    from transformers import AutoModelForCausalLM

    r = client.completions.create(model=MODEL, prompt=[1, 403, 407, 261, 378], max_tokens=4, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert lp.text_offset[0] == 0 and "".join(lp.tokens) == r.choices[0].text
    model = AutoModelForCausalLM.from_pretrained(stories_path)
    ids = [1, 403, 407, 261, 378]
    with torch.no_grad():
        for k in range(4):
            logits = model(torch.tensor([ids])).logits[0, -1]
            ref = torch.log_softmax(logits.float(), -1)
            nxt = int(logits.argmax())
            assert math.isclose(lp.token_logprobs[k], float(ref[nxt]), abs_tol=1e-4)
            assert len(lp.top_logprobs[k]) == 2
            ids.append(nxt)


def test_curl_streams_sse(server):
    curl = shutil.which("curl")
    if curl is None:
        pytest.skip("curl is not installed")
    out = subprocess.run(
        [curl, "-sN", f"{server.base_url}/v1/chat/completions", "-H", "Content-Type: application/json", "-d",
         '{"model": "stories260K", "messages": [{"role": "user", "content": "Once upon a time"}], '
         '"max_tokens": 10, "stream": true}'],
        capture_output=True, text=True, timeout=60,
    )
    lines = [line for line in out.stdout.splitlines() if line]
    assert len(lines) >= 12 and all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"


def test_a_stop_string_completed_by_the_last_allowed_token_is_a_stop(client):
    # ", there was a little girl": " g", "ir", "l" are tokens 6-8; "girl" completes on the 8th.
    r = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=0, stop=["girl"])
    assert r.choices[0].text == ", there was a little " and r.choices[0].finish_reason == "stop"


def test_reusing_a_native_request_id_never_mixes_outputs(server):
    import httpx

    url = server.base_url + "/generate"
    body = {"text": "Once upon a time", "rid": "same", "sampling_params": {"temperature": 0, "max_new_tokens": 40}}
    fresh = httpx.post(url, json=body, timeout=30).json()
    for _ in range(3):  # a stop string ends each early while the scheduler is still producing
        stopped = httpx.post(url, json={**body, "sampling_params": {**body["sampling_params"], "stop": " was"}},
                             timeout=30).json()
        assert stopped["text"] == ", there" and stopped["meta_info"]["id"] == "same"
        again = httpx.post(url, json=body, timeout=30).json()
        assert again["text"] == fresh["text"] and again["meta_info"]["finish_reason"] == "length"
