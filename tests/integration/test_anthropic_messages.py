"""Anthropic's Messages API through the official `anthropic` client against the live server:
answers equal to the chat route's on the same conversation (one pipeline), stop sequences,
streams whose events follow Anthropic's published order and which the client accumulates into
the same message, a tool_use round trip with a tool_result, count_tokens, Anthropic-shaped
errors naming the field, and x-api-key as the API key."""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import pytest

MODEL = "stories260K"
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"]}
TOOLS = [{"name": "get_weather", "description": "the forecast", "input_schema": WEATHER}]
ASK = [{"role": "user", "content": "Once upon a time"}]
# The anthropic client no longer has sampling arguments (Anthropic's newest models take none);
# the API's temperature, top_p and top_k are still served, for the clients that send them.
GREEDY = {"extra_body": {"temperature": 0.0}}


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60)


def test_a_message_is_the_chat_answer(claude, client):
    m = claude.messages.create(model=MODEL, max_tokens=24, **GREEDY, system="Tell a story.", messages=ASK)
    chat = client.chat.completions.create(model=MODEL, max_tokens=24, temperature=0.0, messages=[
        {"role": "system", "content": "Tell a story."}, *ASK])
    assert m.id.startswith("msg_") and m.type == "message" and m.role == "assistant" and m.model == MODEL
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == chat.choices[0].message.content
    assert m.stop_reason == "max_tokens" and m.stop_sequence is None
    assert m.usage.output_tokens == 24
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == chat.usage.prompt_tokens


def test_a_stop_sequence_is_reported(claude, client):
    m = claude.messages.create(model=MODEL, max_tokens=60, **GREEDY, messages=ASK, stop_sequences=["zzz", "."])
    chat = client.chat.completions.create(model=MODEL, max_tokens=60, temperature=0.0, messages=ASK, stop=["zzz", "."])
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == "."
    assert m.content[0].text == chat.choices[0].message.content and "." not in m.content[0].text


def _events(server, body: dict) -> list[tuple[str, dict]]:
    """(event name, data) of a raw stream; every event's name is its data's type."""
    with httpx.stream("POST", server.base_url + "/v1/messages", json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        text = "".join(r.iter_text())
    out = []
    for frame in text.strip().split("\n\n"):
        name, data = frame.split("\n")
        assert name.startswith("event: ") and data.startswith("data: "), frame
        payload = json.loads(data.removeprefix("data: "))
        assert payload["type"] == name.removeprefix("event: ")
        out.append((payload["type"], payload))
    return out


def _check_order(events: list[tuple[str, dict]]) -> None:
    """Anthropic's published order: message_start; per block content_block_start, its deltas,
    content_block_stop (indices 0, 1, ...); message_delta; message_stop; ping anywhere between."""
    names = [n for n, _ in events if n != "ping"]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    open_index, next_index = None, 0
    for name, data in events[1:-2]:
        if name == "content_block_start":
            assert open_index is None and data["index"] == next_index
            open_index = next_index
        elif name == "content_block_delta":
            assert data["index"] == open_index
        elif name == "content_block_stop":
            assert data["index"] == open_index
            open_index, next_index = None, next_index + 1
        else:
            assert name == "ping", name
    assert open_index is None


def test_a_stream_follows_the_event_order_and_accumulates_to_the_message(claude, server):
    body = {"model": MODEL, "max_tokens": 30, "messages": ASK}
    whole = claude.messages.create(**body, **GREEDY)
    events = _events(server, {**body, "temperature": 0.0})
    _check_order(events)
    deltas = "".join(d["delta"]["text"] for n, d in events if n == "content_block_delta")
    assert deltas == whole.content[0].text
    final = events[-2][1]
    assert final["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert final["usage"]["output_tokens"] == 30
    with claude.messages.stream(**body, **GREEDY) as stream:
        text = "".join(stream.text_stream)
        message = stream.get_final_message()
    assert text == whole.content[0].text
    assert message.content[0].text == text and message.stop_reason == "max_tokens"
    assert message.usage.output_tokens == 30


@pytest.mark.parametrize("stream", [False, True])
def test_a_tool_use_round_trip(claude, stream):
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    body = {"model": MODEL, "max_tokens": 200, "messages": ask, "tools": TOOLS,
            "tool_choice": {"type": "tool", "name": "get_weather"}, **GREEDY}
    if stream:
        with claude.messages.stream(**body) as s:
            m = s.get_final_message()
    else:
        m = claude.messages.create(**body)
    assert m.stop_reason == "tool_use"
    (use,) = [b for b in m.content if b.type == "tool_use"]
    assert use.name == "get_weather" and use.id.startswith("toolu_")
    jsonschema.validate(use.input, WEATHER)
    turn = [*ask, {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "Sunny, 24 degrees."}]}]
    answer = claude.messages.create(model=MODEL, max_tokens=20, messages=turn, tools=TOOLS, **GREEDY)
    assert answer.stop_reason == "max_tokens" and answer.content[0].type == "text" and answer.content[0].text
    counted = claude.messages.count_tokens(model=MODEL, messages=turn, tools=TOOLS).input_tokens
    # The result is in the prompt: more tokens than the question and the call alone.
    assert answer.usage.input_tokens + answer.usage.cache_read_input_tokens == counted
    assert counted > claude.messages.count_tokens(model=MODEL, messages=ask, tools=TOOLS).input_tokens + 10


def test_count_tokens_is_the_prompt(claude):
    m = claude.messages.create(model=MODEL, max_tokens=2, messages=ASK, system=[{"type": "text", "text": "Be brief."}])
    counted = claude.messages.count_tokens(model=MODEL, messages=ASK, system=[{"type": "text", "text": "Be brief."}])
    assert counted.input_tokens == m.usage.input_tokens + m.usage.cache_read_input_tokens


def test_the_client_sees_its_error_types(claude):
    """(The bad-input corpus, tests/bad_inputs.py, sends this route's bad requests.)"""
    with pytest.raises(anthropic.NotFoundError) as e:
        claude.messages.create(model="claude-sonnet-4-5", max_tokens=8, messages=ASK)
    assert e.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError):
        claude.messages.create(model=MODEL, max_tokens=8, messages=[{"role": "user", "content": []}])


def test_x_api_key_is_the_api_key(guarded_server):
    good = anthropic.Anthropic(base_url=guarded_server.base_url, api_key="sekrit", max_retries=0)
    m = good.messages.create(model=MODEL, max_tokens=4, messages=ASK)
    assert m.usage.output_tokens == 4
    bad = anthropic.Anthropic(base_url=guarded_server.base_url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as e:
        bad.messages.create(model=MODEL, max_tokens=4, messages=ASK)
    assert e.value.body["error"]["type"] == "authentication_error"
    # x-api-key is Anthropic's header: the OpenAI routes still want a bearer token.
    r = httpx.post(guarded_server.base_url + "/v1/chat/completions", headers={"x-api-key": "sekrit"},
                   json={"messages": ASK, "max_tokens": 1}, timeout=30)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
