"""The official openai client against a live server on the embedded story model."""

import json
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


@pytest.mark.parametrize("final", [False, True])
def test_continuous_usage_stats(client, final):
    """vLLM's stream_options.continuous_usage_stats: every chunk carries the usage so far (its
    completion tokens those of the chunks sent, over both choices), with or without the final
    usage chunk of include_usage."""
    stream = client.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=6, n=2, temperature=0, stream=True,
        stream_options={"include_usage": final, "continuous_usage_stats": True},
    )
    chunks = list(stream)
    for c in chunks[:-1] if final else chunks:
        assert c.usage.prompt_tokens == 5 and c.usage.completion_tokens <= 12
        assert c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens
    assert chunks[-1].usage.completion_tokens == 12
    assert [c.usage.completion_tokens for c in chunks] == sorted(c.usage.completion_tokens for c in chunks)
    assert (chunks[-1].choices == []) == final


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
    assert all(line.startswith("data: ") for line in lines) and lines[-1] == "data: [DONE]"
    # Tokens waiting together go out as one chunk (a busy machine merges some): check what they
    # carry, not how many chunks there are.
    chunks = [json.loads(line[len("data: "):]) for line in lines[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text.strip() and chunks[-1]["choices"][0]["finish_reason"] in ("length", "stop")


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


def _prompt_logprobs_reference(stories_path, ids):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(stories_path, torch_dtype=torch.float64)
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([ids])).logits[0], -1)
    return [None] + [float(lp[i - 1, ids[i]]) for i in range(1, len(ids))], lp


def test_echo_with_logprobs_scores_the_prompt(client, stories_path):
    """echo + logprobs: the prompt's tokens with their logprobs (the first null) before the
    completion's, as OpenAI's legacy API and vLLM answer; max_tokens 0 scores the prompt only.
    The tolerance is float32 rounding of a 5-layer model (the values are float64 references)."""
    ids = [1, 403, 407, 261, 378, 432]
    want, lp = _prompt_logprobs_reference(stories_path, ids)
    for max_tokens, stream in ((0, False), (3, False), (0, True), (3, True)):
        kw = dict(model=MODEL, prompt=ids, max_tokens=max_tokens, temperature=0, echo=True, logprobs=2)
        if stream:
            chunks = list(client.completions.create(**kw, stream=True))
            text = "".join(c.choices[0].text for c in chunks)
            tokens, token_lps, tops = [], [], []
            for c in chunks:
                if c.choices[0].logprobs is not None:
                    tokens += c.choices[0].logprobs.tokens
                    token_lps += c.choices[0].logprobs.token_logprobs
                    tops += c.choices[0].logprobs.top_logprobs
            finish = chunks[-1].choices[0].finish_reason
        else:
            r = client.completions.create(**kw)
            text, finish = r.choices[0].text, r.choices[0].finish_reason
            tokens, token_lps, tops = r.choices[0].logprobs.tokens, r.choices[0].logprobs.token_logprobs, \
                r.choices[0].logprobs.top_logprobs
            assert r.usage.completion_tokens == max_tokens and r.usage.prompt_tokens == 6
        # A token-id prompt is echoed with its special tokens (what the client sent, as vLLM echoes it).
        assert text.startswith("<s> Once upon a time,") and finish == "length"
        assert len(tokens) == len(token_lps) == len(tops) == 6 + max_tokens
        assert token_lps[0] is None and tops[0] is None
        for i in range(1, 6):
            assert math.isclose(token_lps[i], want[i], abs_tol=1e-4), (i, token_lps[i], want[i])
            assert len(tops[i]) == 2 and max(tops[i].values()) >= token_lps[i] - 1e-6
        if max_tokens == 0:
            assert text == "<s> Once upon a time,"


def test_echo_offsets_index_into_the_text(client):
    """Each echoed token's text_offset points at it in `text`, special tokens and all; a text
    prompt's echo is the prompt (the BOS the tokenizer added takes no room in it)."""
    for prompt, keeps_special in (([0, 0, 1, 291, 403], True), ("Once upon a time", False)):
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0, echo=True, logprobs=1)
        text, lp = r.choices[0].text, r.choices[0].logprobs
        if keeps_special:
            assert text.startswith("<unk><unk><s> The")
        else:
            assert text.startswith("Once upon a time")
        assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
        for token, offset in zip(lp.tokens, lp.text_offset):
            if keeps_special or token != "<s>":
                assert text[offset:].startswith(token.lstrip(" ") if offset == 0 else token), (token, offset, text)


def test_generate_returns_input_and_output_logprobs(server, stories_path):
    """/generate's SGLang fields: input_token_logprobs from logprob_start_len on, output ones,
    top alternatives and their text."""
    import httpx

    ids = [1, 403, 407, 261, 378, 432]
    want, lp = _prompt_logprobs_reference(stories_path, ids)
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 3, "temperature": 0}, "return_logprob": True,
            "logprob_start_len": 2, "top_logprobs_num": 3, "return_text_in_logprobs": True}
    meta = httpx.post(server.base_url + "/generate", json=body, timeout=60).json()["meta_info"]
    inp = meta["input_token_logprobs"]
    assert [t for _, t, _ in inp] == ids[2:] and inp[0][2] == " upon"
    for (got, _, _), ref in zip(inp, want[2:]):
        assert math.isclose(got, ref, abs_tol=1e-4)
    assert all(len(top) == 3 and top[0][0] >= top[1][0] >= top[2][0] for top in meta["input_top_logprobs"])
    assert len(meta["output_token_logprobs"]) == len(meta["output_top_logprobs"]) == 3
    # Greedy: each output token is its row's best alternative.
    assert all(top[0][1] == tok for (_, tok, _), top in zip(meta["output_token_logprobs"], meta["output_top_logprobs"]))
    # Without logprob_start_len (-1): output logprobs only; from 0 the first prompt token has none.
    plain = httpx.post(server.base_url + "/generate", json={**body, "logprob_start_len": -1}, timeout=60).json()
    assert plain["meta_info"]["input_token_logprobs"] == [] and len(plain["meta_info"]["output_token_logprobs"]) == 3
    zero = httpx.post(server.base_url + "/generate", json={**body, "logprob_start_len": 0}, timeout=60).json()
    assert zero["meta_info"]["input_token_logprobs"][0] == [None, 1, "<s>"]
    assert zero["meta_info"]["input_top_logprobs"][0] is None


def test_tokenizer_info(server):
    import httpx

    info = httpx.get(server.base_url + "/tokenizer_info", timeout=30).json()
    assert info["eos_token"] == "</s>" and info["bos_token"] == "<s>" and info["model_max_length"] == 512
