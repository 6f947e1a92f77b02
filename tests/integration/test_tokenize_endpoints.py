"""/tokenize, /detokenize and /version against the live server: the tokens the completions use,
vLLM's shapes, and bad input answered with a 400 naming the field."""

from __future__ import annotations

import httpx
import pytest
from transformers import AutoTokenizer

import batonlm
from batonlm.config import EMBEDDED_MODEL

MODEL = "stories260K"


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(EMBEDDED_MODEL)


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.base_url + path, json=body, timeout=30)


def test_tokenize_a_prompt(server, tokenizer):
    text = "Once upon a time, there was a little girl named Lily."
    r = _post(server, "/tokenize", {"model": MODEL, "prompt": text})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == tokenizer(text).input_ids and body["tokens"][0] == tokenizer.bos_token_id
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == 512
    assert "token_strs" not in body
    plain = _post(server, "/tokenize", {"prompt": text, "add_special_tokens": False, "return_token_strs": True}).json()
    assert plain["tokens"] == body["tokens"][1:]
    assert plain["token_strs"] == tokenizer.convert_ids_to_tokens(plain["tokens"])


def test_tokenize_messages_gives_the_prompt_a_chat_completion_uses(server, client):
    messages = [{"role": "user", "content": "Once upon a time"}, {"role": "assistant", "content": "there was"},
                {"role": "user", "content": "a dog"}]
    tokens = _post(server, "/tokenize", {"model": MODEL, "messages": messages}).json()
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1)
    assert tokens["count"] == chat.usage.prompt_tokens
    # The built-in template of this base model adds no generation prompt: the same tokens.
    without = _post(server, "/tokenize", {"messages": messages, "add_generation_prompt": False}).json()
    assert without["tokens"] == tokens["tokens"]


def test_detokenize_round_trip(server, tokenizer):
    text = "Lily saw a big, red ball."
    ids = _post(server, "/tokenize", {"prompt": text, "add_special_tokens": False}).json()["tokens"]
    r = _post(server, "/detokenize", {"model": MODEL, "tokens": ids})
    assert r.status_code == 200, r.text
    assert r.json() == {"prompt": tokenizer.decode(ids)} and r.json()["prompt"] == text
    assert _post(server, "/detokenize", {"tokens": []}).json() == {"prompt": ""}


def test_version(server):
    r = httpx.get(server.base_url + "/version", timeout=30)
    assert r.status_code == 200 and r.json() == {"version": batonlm.__version__}


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, None),
        ("/tokenize", {}, None),
        ("/tokenize", {"prompt": 5}, "prompt"),
        ("/tokenize", {"prompt": "a", "add_special_token": True}, "add_special_token"),
        ("/tokenize", {"messages": []}, "messages"),
        ("/detokenize", {"tokens": [1, 512]}, "tokens"),
        ("/detokenize", {"tokens": [1, -3]}, "tokens.1"),
        ("/detokenize", {"tokens": "1 2"}, "tokens"),
        ("/detokenize", {}, "tokens"),
    ],
)
def test_bad_input_is_a_400_naming_the_field(server, path, body, param):
    r = _post(server, path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    assert "Traceback" not in err["message"]


@pytest.mark.parametrize("path", ["/tokenize", "/detokenize"])
def test_another_model_is_a_404(server, path):
    r = _post(server, path, {"model": "gpt-17", "prompt": "a"} if path == "/tokenize" else {"model": "gpt-17", "tokens": [1]})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
