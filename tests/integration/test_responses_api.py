"""OpenAI's Responses API through the official `openai` client against the live server: answers
equal to the chat route's on the same conversation (one pipeline), previous_response_id chains,
streams whose typed events follow the published order with consecutive sequence numbers,
json_schema output, a function-tool round trip, the store (GET, DELETE, background, cancel),
errors naming the field, and an OpenAI Agents SDK agent with one tool finishing a two-step task."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import jsonschema
import openai
import pytest

MODEL = "stories260K"
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"]}
TOOLS = [{"type": "function", "name": "get_weather", "description": "the forecast", "parameters": WEATHER}]


def test_a_response_is_the_chat_answer(client):
    r = client.responses.create(model=MODEL, instructions="Tell a story.", input="Once upon a time",
                                max_output_tokens=24, temperature=0.0)
    chat = client.chat.completions.create(model=MODEL, max_tokens=24, temperature=0.0, messages=[
        {"role": "system", "content": "Tell a story."}, {"role": "user", "content": "Once upon a time"}])
    assert r.id.startswith("resp_") and r.object == "response" and r.model == MODEL
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert [o.type for o in r.output] == ["message"] and r.output_text == chat.choices[0].message.content
    assert r.output[0].status == "incomplete"
    assert r.usage.input_tokens == chat.usage.prompt_tokens and r.usage.output_tokens == 24
    assert r.usage.total_tokens == r.usage.input_tokens + 24


def test_previous_response_id_continues_the_conversation(client):
    first = client.responses.create(model=MODEL, instructions="Tell a story.", input="Once upon a time",
                                    max_output_tokens=12, temperature=0.0)
    second = client.responses.create(model=MODEL, input="And then?", previous_response_id=first.id,
                                     max_output_tokens=12, temperature=0.0)
    # The same conversation written out (the first's instructions are not carried on).
    chat = client.chat.completions.create(model=MODEL, max_tokens=12, temperature=0.0, messages=[
        {"role": "user", "content": "Once upon a time"}, {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And then?"}])
    assert second.output_text == chat.choices[0].message.content
    assert second.usage.input_tokens == chat.usage.prompt_tokens
    assert second.previous_response_id == first.id
    counted = httpx.post(str(client.base_url).rstrip("/") + "/responses/input_tokens", timeout=30, json={
        "model": MODEL, "input": "And then?", "previous_response_id": first.id}).json()
    assert counted["input_tokens"] == second.usage.input_tokens
    assert client.responses.retrieve(second.id).output_text == second.output_text


def _check_order(events: list[dict]) -> None:
    """The published order: response.created, response.in_progress; per output item
    output_item.added, (for a message content_part.added) its deltas, its .done events,
    output_item.done; the final response.completed / response.incomplete. sequence_number 0, 1, ..."""
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    types = [e["type"] for e in events]
    assert types[:2] == ["response.created", "response.in_progress"]
    assert types[-1] in ("response.completed", "response.incomplete")
    index, item = -1, None
    for e in events[2:-1]:
        t = e["type"]
        if t == "response.output_item.added":
            assert item is None and e["output_index"] == index + 1
            index, item = e["output_index"], e["item"]
        elif t == "response.output_item.done":
            assert item is not None and e["item"]["id"] == item["id"] and e["output_index"] == index
            item = None
        else:
            assert item is not None and e["item_id"] == item["id"] and e["output_index"] == index, e
    assert item is None


def test_a_stream_follows_the_event_order_and_ends_in_the_response(client, server):
    body = {"model": MODEL, "input": "Once upon a time", "max_output_tokens": 30, "temperature": 0.0}
    whole = client.responses.create(**body)
    with httpx.stream("POST", server.base_url + "/v1/responses", json={**body, "stream": True}, timeout=60) as r:
        frames = "".join(r.iter_text()).strip().split("\n\n")
    events = []
    for frame in frames:
        name, data = frame.split("\n")
        events.append(json.loads(data.removeprefix("data: ")))
        assert name == "event: " + events[-1]["type"]
    _check_order(events)
    types = [e["type"] for e in events]
    assert types[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert text == whole.output_text
    done = next(e for e in events if e["type"] == "response.output_text.done")
    assert done["text"] == text
    final = events[-1]["response"]
    assert final["status"] == "incomplete" and final["output"][0]["content"][0]["text"] == text
    assert final["usage"]["output_tokens"] == 30
    # The client's stream helper reads the same events.
    with client.responses.stream(**body) as stream:
        deltas = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
    assert deltas == text


def test_json_schema_output_validates(client):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["name", "age"], "additionalProperties": False}
    r = client.responses.create(model=MODEL, input="A person", max_output_tokens=120, temperature=0.0,
                                text={"format": {"type": "json_schema", "name": "person", "schema": schema}})
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), schema)


@pytest.mark.parametrize("stream", [False, True])
def test_a_function_tool_round_trip(client, stream):
    body = {"model": MODEL, "input": "What is the weather in Paris?", "tools": TOOLS, "max_output_tokens": 200,
            "tool_choice": {"type": "function", "name": "get_weather"}, "temperature": 0.0}
    if stream:
        with client.responses.stream(**body) as s:
            r = s.get_final_response()
    else:
        r = client.responses.create(**body)
    (call,) = [o for o in r.output if o.type == "function_call"]
    assert call.name == "get_weather" and call.call_id and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    answer = client.responses.create(model=MODEL, previous_response_id=r.id, tools=TOOLS, max_output_tokens=16,
                                     temperature=0.0, input=[{"type": "function_call_output", "call_id": call.call_id,
                                                              "output": "Sunny, 24 degrees."}])
    assert answer.output_text
    # The same turn with the call and its output given in full instead of by reference.
    full = client.responses.create(model=MODEL, tools=TOOLS, max_output_tokens=16, temperature=0.0, input=[
        {"role": "user", "content": "What is the weather in Paris?"},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 24 degrees."}])
    assert full.output_text == answer.output_text and full.usage.input_tokens == answer.usage.input_tokens


# A string no shorter than this runs a response to the context length (hundreds of tokens).
LONG = {"format": {"type": "json_schema", "name": "long", "schema": {"type": "string", "minLength": 5000}}}


def test_the_store_get_delete_background_cancel(client):
    r = client.responses.create(model=MODEL, input="Once", max_output_tokens=4)
    assert client.responses.retrieve(r.id).output_text == r.output_text
    with pytest.raises(openai.BadRequestError):  # not a background response
        client.responses.cancel(r.id)
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    unstored = client.responses.create(model=MODEL, input="Once", max_output_tokens=4, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    background = client.responses.create(model=MODEL, input="Once", max_output_tokens=8, background=True)
    assert background.status == "queued"
    for _ in range(600):
        got = client.responses.retrieve(background.id)
        if got.status not in ("queued", "in_progress"):
            break
        time.sleep(0.05)
    assert got.status == "incomplete" and got.usage.output_tokens == 8
    # A cancel is sent as soon as the response is queued; one that finished first (a machine
    # far faster than this one) is tried again: a cancel that never cancels fails every try.
    for _ in range(5):
        long = client.responses.create(model=MODEL, input="Once", text=LONG, background=True)
        cancelled = client.responses.cancel(long.id)
        if cancelled.status != "incomplete":
            break
    assert cancelled.status == "cancelled" and client.responses.retrieve(long.id).status == "cancelled"


@pytest.mark.parametrize(
    ("change", "param", "status"),
    [
        ({"input": [{"type": "input_image", "image_url": "x"}]}, "input", 400),
        ({"input": []}, "input", 400),
        ({"max_tokens": 5}, "max_tokens", 400),
        ({"previous_response_id": "resp_nope"}, "previous_response_id", 404),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "fly"}}, "tool_choice", 400),
        ({"tools": [{"type": "function", "name": "f", "parameters": {"type": "objec"}}]}, "tools.0.parameters", 400),
        ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "objec"}}}},
         "text.format.schema", 400),
        ({"reasoning": {"effort": "high"}}, "reasoning.effort", 400),
        ({"include": ["message.output_text.logprobs"]}, "include.0", 400),
        ({"background": True, "store": False}, None, 400),
        ({"max_output_tokens": 10**6}, "max_output_tokens", 400),
    ],
)
def test_bad_requests_name_the_field(server, change, param, status):
    r = httpx.post(server.base_url + "/v1/responses", json={"model": MODEL, "input": "Once", **change}, timeout=30)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param, r.text


def test_an_agents_sdk_agent_finishes_a_two_step_task(server):
    """An OpenAI Agents SDK agent with one function tool and a structured output: its first turn
    must call the tool (tool_choice required; the SDK sends the output format too), the SDK runs
    the tool and sends its output back, and the second turn (tool_choice free again, the SDK's
    default reset) answers in the output type's JSON: the run's final output."""
    from agents import Agent, ModelSettings, OpenAIResponsesModel, RunConfig, Runner, function_tool
    from pydantic import BaseModel, Field

    class Weather(BaseModel):
        answer: str = Field(max_length=20)

    calls: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        calls.append(city)
        return f"Sunny in {city}."

    async def run():
        client = openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)
        agent = Agent(name="weather", instructions="Answer with the weather.", tools=[get_weather],
                      output_type=Weather, model=OpenAIResponsesModel(model=MODEL, openai_client=client),
                      model_settings=ModelSettings(tool_choice="required", parallel_tool_calls=False,
                                                   temperature=0.0))
        return await Runner.run(agent, "What is the weather in Paris?", max_turns=3,
                                run_config=RunConfig(tracing_disabled=True))

    result = asyncio.run(run())
    assert len(calls) == 1 and isinstance(calls[0], str)
    assert isinstance(result.final_output, Weather) and len(result.raw_responses) == 2
    first, second = result.raw_responses
    assert [o.type for o in first.output] == ["function_call"] and second.output[-1].type == "message"
