"""Tool calling through the official openai client against the live server: tool_choice
required and named give calls whose arguments validate (streamed and not, n=2), a tool result
message continues a conversation, bad tools are 400s naming the field; and a chat template
that renders tools gets them, with the calls and results of earlier turns."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

MODEL = "stories260K"
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"]}
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                        "b": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["a", "b"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "the forecast", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "parameters": ADD}}]
PARAMS = {"get_weather": WEATHER, "add": ADD}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def merged(deltas):
    """Streamed delta.tool_calls put together by index (a call's first delta has its id and name,
    the next ones more of its arguments), as a client accumulates them."""
    from types import SimpleNamespace

    calls: dict[int, SimpleNamespace] = {}
    for d in deltas:
        if d.index not in calls:
            assert d.id and d.type == "function" and d.function.name, d  # a call opens with its id and name
            calls[d.index] = SimpleNamespace(id=d.id, type="function", index=d.index,
                                             function=SimpleNamespace(name=d.function.name, arguments=""))
        calls[d.index].function.arguments += d.function.arguments or ""
    assert list(calls) == list(range(len(calls)))
    return list(calls.values())


def _check_calls(calls, only: str | None = None):
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert only is None or call.function.name == only
        jsonschema.validate(json.loads(call.function.arguments), PARAMS[call.function.name])


@pytest.mark.parametrize("choice", ["required", "named"])
def test_forced_calls_validate(client, choice):
    tool_choice = "required" if choice == "required" else {"type": "function", "function": {"name": "add"}}
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=tool_choice, n=2,
                                       max_tokens=200, temperature=0.9, seed=3, parallel_tool_calls=False)
    for c in r.choices:
        assert c.finish_reason == "tool_calls" and c.message.content is None
        _check_calls(c.message.tool_calls, None if choice == "required" else "add")
        assert len(c.message.tool_calls) == 1


@pytest.mark.parametrize("choice", ["required", "named"])
def test_forced_calls_validate_streamed(client, choice):
    tool_choice = "required" if choice == "required" else {"type": "function", "function": {"name": "get_weather"}}
    stream = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=tool_choice, n=2,
                                            max_tokens=200, temperature=0.0, stream=True, parallel_tool_calls=False)
    calls, finish = {0: [], 1: []}, {}
    for chunk in stream:
        for c in chunk.choices:
            assert not c.delta.content
            calls[c.index] += c.delta.tool_calls or []
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    assert finish == {0: "tool_calls", 1: "tool_calls"}
    for i in (0, 1):
        assert len(calls[i]) > 2  # the arguments came in pieces, as they were written
        _check_calls(merged(calls[i]), None if choice == "required" else "get_weather")


def test_parallel_required_calls_are_an_array(client):
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                       max_tokens=300, temperature=0.0, logit_bias={"96": 20})  # "]" (0x5D)
    assert r.choices[0].finish_reason == "tool_calls"
    _check_calls(r.choices[0].message.tool_calls)


def test_auto_without_a_call_is_plain_content(client):
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=20, temperature=0.0)
    assert r.choices[0].finish_reason == "length" and r.choices[0].message.tool_calls is None
    assert r.choices[0].message.content
    plain = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=20, temperature=0.0)
    assert r.choices[0].message.content == plain.choices[0].message.content  # the built-in template has no tools


def test_multi_turn_with_a_tool_result(client):
    messages = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 1}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 24 degrees."},
    ]
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=20, temperature=0.0)
    assert r.choices[0].message.content
    # The result is in the prompt (the built-in template writes each message's content).
    plain = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=20, temperature=0.0)
    assert r.usage.prompt_tokens > plain.usage.prompt_tokens


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "fly"}}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objec"}}}]},
         "tools.0.function.parameters"),
        ({"tools": [TOOLS[0], TOOLS[0]]}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools.0.function.name"),
        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ],
)
def test_bad_tools_are_400s_naming_the_field(client, extra, param):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=5, **extra)
    assert err.value.body["param"] == param, err.value.body


@pytest.mark.parametrize(
    ("message", "param"),
    [
        ({"role": "tool", "content": "x"}, "messages.1"),
        ({"role": "user", "content": "x", "tool_calls": []}, "messages.1"),
    ],
)
def test_bad_tool_messages_are_400s(server, message, param):
    r = httpx.post(server.base_url + "/v1/chat/completions", json={"model": MODEL, "messages": ASK + [message]},
                   timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


HERMES_TEMPLATE = (
    "{% if tools %}<tools>{% for t in tools %}{{ t['function']['name'] }};{% endfor %}</tools>\n{% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'tool' %}<tool_response>{{ m['content'] }}</tool_response>\n"
    "{% elif m.get('tool_calls') %}{% for c in m['tool_calls'] %}<tool_call>{{ c['function']['name'] }}"
    "{{ c['function']['arguments'] | tojson }}</tool_call>{% endfor %}\n"
    "{% else %}{{ m['role'] }}: {{ m['content'] }}\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def test_a_chat_template_renders_the_tools_calls_and_results(stories_path):
    """What the server gives a model's template: the tools, an earlier turn's calls with their
    arguments as objects, and the tool's result."""
    from transformers import AutoTokenizer

    from batonlm.server.protocol import ChatCompletionRequest
    from batonlm.tokenizer_manager.chat_template import apply_chat_template

    tok = AutoTokenizer.from_pretrained(stories_path)
    tok.chat_template = HERMES_TEMPLATE
    req = ChatCompletionRequest.model_validate({"messages": ASK + [
        {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
                                              "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "3"}], "tools": TOOLS})
    ids = apply_chat_template(tok, [m.template_dict() for m in req.messages],
                              tools=[t.model_dump(exclude_none=True) for t in req.tools])
    text = tok.decode(ids)
    assert "<tools>get_weather;add;</tools>" in text
    assert '<tool_call>add{"a": 1, "b": 2}</tool_call>' in text
    assert "<tool_response>3</tool_response>" in text and text.endswith("assistant:")


def test_reasoning_parser_splits_the_answer():
    """--reasoning-parser deepseek-r1: the output starts inside the thinking block, so a story
    model's whole answer (it never closes the block) is reasoning_content, streamed and not; the
    same in Anthropic's thinking blocks and the Responses API's reasoning items."""
    from batonlm.bench.server_process import ServerProcess

    server = ServerProcess("--reasoning-parser", "deepseek-r1")
    try:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0)
        r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=20, temperature=0.0)
        message = r.choices[0].message
        assert message.content == "" and len(message.reasoning_content) > 20
        reasoning = ""
        for chunk in client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=20, temperature=0.0,
                                                    stream=True):
            for c in chunk.choices:
                assert not c.delta.content
                reasoning += getattr(c.delta, "reasoning_content", None) or ""
        assert reasoning == message.reasoning_content
        # The other dialects: Anthropic's thinking blocks, the Responses API's reasoning items.
        import anthropic

        claude = anthropic.Anthropic(base_url=server.base_url, api_key="x", max_retries=0)
        body = {"model": MODEL, "max_tokens": 20, "messages": ASK, "extra_body": {"temperature": 0.0},
                "thinking": {"type": "enabled", "budget_tokens": 1024}}
        m = claude.messages.create(**body)
        assert [b.type for b in m.content] == ["thinking"] and m.content[0].thinking == message.reasoning_content
        with claude.messages.stream(**body) as s:
            assert s.get_final_message().content[0].thinking == message.reasoning_content
        r = client.responses.create(model=MODEL, input=ASK[0]["content"], max_output_tokens=20, temperature=0.0)
        assert [o.type for o in r.output] == ["reasoning"] and r.output[0].content[0].text == message.reasoning_content
        with client.responses.stream(model=MODEL, input=ASK[0]["content"], max_output_tokens=20, temperature=0.0) as s:
            deltas = "".join(e.delta for e in s if e.type == "response.reasoning_text.delta")
        assert deltas == message.reasoning_content
    finally:
        assert server.stop() == 0


PROMPTS = [
    "What is the weather in Paris?", "Add 2 and 3.", "Once upon a time", "Lily went to the park.", "Tell me a story.",
    "How warm is it in Rome for 3 days?", "What is 40 plus 2?", "The cat sat on the mat.", "Is it raining in Oslo?",
    "Sum 7 and 8 please.", "Tim had a red ball.", "Weather for Lima, 5 days.", "What do you know?", "Hello!",
    "Compute 11 + 12.", "The sun was hot.", "Forecast for Tokyo.", "Add 99 and 1.", "A dog ran fast.", "Goodbye.",
]


def test_required_returns_calls_for_every_prompt(client):
    """tool_choice required with parallel calls (the default) on a model that knows no tools and
    would add calls until max_tokens: every one of 20 prompts gets at least one valid call (the
    array is ended once the next call could not fit; a call cut short is dropped)."""
    from concurrent.futures import ThreadPoolExecutor

    def ask(prompt: str):
        return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                              tools=TOOLS, tool_choice="required", temperature=0.0)

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(ask, PROMPTS))
    for prompt, r in zip(PROMPTS, answers):
        c = r.choices[0]
        assert c.finish_reason in ("tool_calls", "length") and c.message.content is None, (prompt, c)
        _check_calls(c.message.tool_calls)


@pytest.mark.parametrize("stream", [False, True])
def test_max_tokens_after_one_complete_call_returns_it(client, stream):
    """max_tokens a little past the first call: that call comes back (the array ended before a
    second that could not complete, or the second cut short and dropped)."""
    whole = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                           temperature=0.0, max_tokens=400)
    first = whole.choices[0].message.tool_calls[0]
    one = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                         temperature=0.0, max_tokens=whole.usage.completion_tokens // 2 + 8,
                                         stream=stream)
    if stream:
        calls, finish = [], None
        for chunk in one:
            for c in chunk.choices:
                assert not c.delta.content
                calls += c.delta.tool_calls or []
                finish = c.finish_reason or finish
    else:
        calls, finish = one.choices[0].message.tool_calls, one.choices[0].finish_reason
    if stream:
        calls = merged(calls)
    assert finish in ("tool_calls", "length")
    assert calls and (calls[0].function.name, json.loads(calls[0].function.arguments)) == (
        first.function.name, json.loads(first.function.arguments))
    _check_calls(calls)
