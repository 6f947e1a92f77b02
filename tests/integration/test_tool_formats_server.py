"""A current tool-call format end to end: a model whose greedy output is exactly a pythonic call
(`[f(a=1)]`, its bytes one after another), served with --tool-call-parser pythonic, answers a
chat request with that call (not text), streamed and not."""

from __future__ import annotations

import json

import openai
import pytest
from helpers import build_byte_cycle_model, copy_tokenizer

from batonlm.bench.server_process import ServerProcess

CALL = "[f(a=1)]"
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}}}}}]
ASK = [{"role": "user", "content": "x]"}]  # its last token, "]" (509), leads into the call


@pytest.fixture(scope="module")
def pythonic_client(tmp_path_factory):
    path = tmp_path_factory.mktemp("pythonic_model")
    build_byte_cycle_model(path, CALL, lead_ids=(1, 509))
    copy_tokenizer(path)
    server = ServerProcess(str(path), "--tool-call-parser", "pythonic", "--served-model-name", "m")
    yield openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)
    assert server.stop() == 0, server.log()


def test_the_call_comes_back_as_a_call(pythonic_client):
    r = pythonic_client.chat.completions.create(model="m", messages=ASK, tools=TOOLS, max_tokens=len(CALL),
                                                temperature=0)
    msg = r.choices[0].message
    assert msg.content is None and len(msg.tool_calls) == 1
    assert (msg.tool_calls[0].function.name, json.loads(msg.tool_calls[0].function.arguments)) == ("f", {"a": 1})
    # Without tools the same output is text.
    plain = pythonic_client.chat.completions.create(model="m", messages=ASK, max_tokens=len(CALL), temperature=0)
    assert plain.choices[0].message.content == CALL


def test_streamed_the_call_is_never_text(pythonic_client):
    stream = pythonic_client.chat.completions.create(model="m", messages=ASK, tools=TOOLS, max_tokens=len(CALL),
                                                     temperature=0, stream=True)
    text, calls = "", []
    for chunk in stream:
        for c in chunk.choices:
            text += c.delta.content or ""
            calls += c.delta.tool_calls or []
    assert text == ""
    assert calls[0].function.name == "f" and json.loads("".join(c.function.arguments or "" for c in calls)) == {"a": 1}
