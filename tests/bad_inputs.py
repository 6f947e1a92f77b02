"""A corpus of bad requests across the five generation routes and the embeddings route, each with the status it must get and the
field its error must name (None: the body as a whole). Used by the tests and by
benchmarks/soak.py. Server defaults assumed: stories260K (vocabulary 512, context 512), and the
default limits (--max-n 16, --max-stop-strings 16, --max-prompts-per-request 256, ...)."""

from __future__ import annotations

CHAT, COMP, GEN = "/v1/chat/completions", "/v1/completions", "/generate"
MSGS, RESP = "/v1/messages", "/v1/responses"  # Anthropic's errors carry no param: the message names it
EMB = "/v1/embeddings"
ROUTES = (CHAT, COMP, GEN, MSGS, RESP, EMB)
MSG = [{"role": "user", "content": "Once upon a time"}]


def _chat(**fields) -> dict:
    return {"messages": MSG, **fields}


def _schema(schema: dict) -> dict:
    return _chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})


def _gen(**sampling) -> dict:
    return {"text": "Once", "sampling_params": sampling}


def _msgs(**fields) -> dict:
    return {"max_tokens": 8, "messages": MSG, **fields}


def _resp(**fields) -> dict:
    return {"input": "Once", "max_output_tokens": 8, **fields}


_SCHEMA = {"type": "object", "properties": {"a": {"type": "objec"}}}


# (path, body: a dict sent as JSON or raw bytes, status, param, words expected in the message)
CORPUS: list[tuple[str, dict | bytes, int, str | None, str | None]] = [
    # -- chat: structure
    (CHAT, {"model": "stories260K"}, 400, "messages", "missing"),
    (CHAT, {"messages": []}, 400, "messages", "at least 1"),
    (CHAT, {"messages": "hello"}, 400, "messages", None),
    (CHAT, {"messages": [{"role": "robot", "content": "hi"}]}, 400, "messages.0.role", None),
    (CHAT, {"messages": [{"role": "user"}]}, 400, "messages", "needs content"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400,
     "messages.0.content", "only text"),
    (CHAT, {"messages": [{"role": "user", "content": [[[["deep"]]]]}]}, 400, "messages.0.content", None),
    (CHAT, _chat(model="gpt-9"), 404, "model", "does not exist"),
    (CHAT, _chat(tools=[{"type": "function"}]), 400, "tools.0.function", "Missing"),
    (CHAT, _chat(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "objec"}}}]), 400,
     "tools.0.function.parameters", "invalid parameters schema"),
    (CHAT, _chat(tool_choice="required"), 400, "tool_choice", "needs tools"),
    (CHAT, _chat(response_format={"type": "yaml"}), 400, "response_format.type", None),
    (CHAT, _chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 3}}}), 400,
     "response_format.json_schema.schema", "invalid json schema"),
    (CHAT, _chat(regex="(unclosed"), 400, "regex", "invalid regex"),
    # -- constraints the grammar backend would ignore (issue 23: 7), and tools beyond OpenAI's 128
    (CHAT, _schema({"type": "object", "not": {"required": ["a"]}}), 400, "response_format.json_schema.schema",
     "'not'"),
    (CHAT, _schema({"allOf": [{"type": "string"}, {"type": "integer"}]}), 400, "response_format.json_schema.schema",
     "allOf"),
    (CHAT, _schema({"$ref": "file:///etc/passwd"}), 400, "response_format.json_schema.schema", "inside the schema"),
    (CHAT, _schema({"enum": [f"value {i}" for i in range(8000)]}), 400, "response_format.json_schema.schema",
     "--max-constraint-bytes"),  # 50,000-value enums blocked every constrained request for minutes
    (COMP, {"prompt": "Once", "regex": "a" * 70_000}, 400, "regex", "--max-constraint-bytes"),
    # refused by the scheduler, naming the field (was param null): an empty language, a dead end after "a"
    (COMP, {"prompt": "Once", "max_tokens": 4, "regex": "[^\\s\\S]"}, 400, "regex", "admits no text"),
    (CHAT, _chat(max_tokens=4, ebnf='root ::= "a" x\nx ::= x "b"'), 400, "ebnf", "dead end"),
    (CHAT, _chat(tools=[{"type": "function", "function": {"name": f"f{i}"}} for i in range(129)]), 400, "tools",
     "at most 128"),
    (CHAT, _chat(user=5), 400, "user", None),
    # -- chat: sampling values
    (CHAT, _chat(temperature="hot"), 400, "temperature", None),
    (CHAT, _chat(temperature=-1), 400, "temperature", "greater than or equal"),
    (CHAT, _chat(temperature=2.5), 400, "temperature", "less than or equal"),
    (CHAT, _chat(top_p=0), 400, "top_p", "greater than"),
    (CHAT, _chat(top_p=1.5), 400, "top_p", None),
    (CHAT, _chat(top_k=-2), 400, "top_k", None),
    (CHAT, _chat(top_k=2**63), 400, "top_k", None),  # killed the server once
    (CHAT, _chat(top_k=1.5), 400, "top_k", None),
    (CHAT, _chat(min_p=2), 400, "min_p", None),
    (CHAT, _chat(n=0), 400, "n", None),
    (CHAT, _chat(n=17), 400, "n", "at most 16"),
    (CHAT, _chat(n=2**64), 400, "n", None),
    (CHAT, _chat(max_tokens=0), 400, "max_tokens", None),
    (CHAT, _chat(max_tokens="ten"), 400, "max_tokens", None),
    (CHAT, _chat(max_tokens=600), 400, "max_tokens", "512"),
    (CHAT, _chat(max_tokens=2**64 - 1), 400, "max_tokens", None),
    (CHAT, _chat(max_tokens=5, max_completion_tokens=6), 400, "max_completion_tokens", "disagrees"),
    (CHAT, _chat(min_tokens=50, max_tokens=10), 400, "min_tokens", "exceeds"),
    (CHAT, _chat(min_tokens=2**63), 400, "min_tokens", None),
    (CHAT, _chat(frequency_penalty=3), 400, "frequency_penalty", None),
    (CHAT, _chat(presence_penalty=-3), 400, "presence_penalty", None),
    (CHAT, _chat(repetition_penalty=0), 400, "repetition_penalty", None),
    (CHAT, _chat(seed=2**64), 400, "seed", None),
    (CHAT, _chat(seed="1"), 400, "seed", None),
    (CHAT, _chat(logit_bias={"abc": 1}), 400, "logit_bias", "token ids"),
    (CHAT, _chat(logit_bias={"\u00b2": 1}), 400, "logit_bias", "token ids"),
    (CHAT, _chat(logit_bias={"99999": 1}), 400, "logit_bias", "outside the vocabulary"),
    (CHAT, _chat(logit_bias={"5": 200}), 400, "logit_bias.5", None),
    (CHAT, _chat(logit_bias={str(i): 1 for i in range(1025)}), 400, "logit_bias", "at most 1024"),
    (CHAT, _chat(stop_token_ids=[70000]), 400, "stop_token_ids", "outside the vocabulary"),
    (CHAT, _chat(stop_token_ids=[-1]), 400, "stop_token_ids.0", None),
    (CHAT, _chat(stop_token_ids=list(range(257))), 400, "stop_token_ids", "at most 256"),
    (CHAT, _chat(stop=[f"s{i}" for i in range(17)]), 400, "stop", "at most 16"),
    (CHAT, _chat(stop=""), 400, "stop", "empty"),
    (CHAT, _chat(stop="x" * 2000), 400, "stop", "at most 1024"),
    (CHAT, _chat(top_logprobs=3), 400, "top_logprobs", "logprobs"),
    (CHAT, _chat(logprobs=True, top_logprobs=21), 400, "top_logprobs", None),
    (CHAT, _chat(stream_options={"include_usage": True}), 400, "stream_options", "stream"),
    (CHAT, _chat(stream="yes"), 400, "stream", None),
    (CHAT, _chat(top_k=2**63, stream=True), 400, "top_k", None),  # a 400, not a 200 and an error event
    # -- chat: bodies that are not JSON, or JSON the parser refuses
    (CHAT, b"{not json", 400, None, "not valid JSON"),
    (CHAT, b"[1, 2]", 400, None, "JSON object"),
    (CHAT, b"", 400, None, None),
    (CHAT, b'{"messages": ' + b"[" * 1000 + b"]" * 1000 + b"}", 400, None, None),
    (CHAT, b'{"messages": [], "max_tokens": ' + b"9" * 5000 + b"}", 400, None, None),
    (CHAT, b'{"messages": [{"role": "user", "content": "\\ud800"}]}', 400, None, "surrogate"),
    (CHAT, b'{"messages": [], "temperature": NaN}', 400, None, None),
    # -- completions
    (COMP, {"prompt": []}, 400, "prompt", "empty"),
    (COMP, {"prompt": 5}, 400, "prompt", None),
    (COMP, {"prompt": [[1, 2], []]}, 400, "prompt", "empty"),
    (COMP, {"prompt": [1, 99999]}, 400, "prompt", "outside the vocabulary"),
    (COMP, {"prompt": [-1]}, 400, "prompt", "outside the vocabulary"),
    (COMP, {"prompt": [[1, 2**64]]}, 400, "prompt.0.1", None),
    (COMP, {"prompt": "x " * 600}, 400, "prompt", "512"),
    (COMP, {"prompt": ["a"] * 300}, 400, "prompt", "at most 256"),
    # 4,096 choices can never be in flight at once (128 running + 2048 queued): a 400, not a 429.
    (COMP, {"prompt": ["Once"] * 256, "n": 16}, 400, "prompt", "can never be admitted"),
    (COMP, {"prompt": "hi", "suffix": "there"}, 400, "suffix", None),
    (COMP, {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens", "only with echo"),
    (COMP, {"prompt": "hi", "best_of": 2}, 400, "best_of", "Unrecognized"),
    (COMP, {"prompt": "hi", "logprobs": 21}, 400, "logprobs", None),
    (COMP, {"prompt": "hi", "top_k": 2**63}, 400, "top_k", None),
    (COMP, b'{"prompt": "\\ud800"}', 400, None, "surrogate"),
    (COMP, b'{"prompt": "\xed\xa0\x80"}', 400, None, None),
    (COMP, b'{"prompt": ' + b"[" * 1000 + b"]" * 1000 + b"}", 400, None, None),
    # -- native /generate
    (GEN, {"text": "hi", "input_ids": [1]}, 400, None, "exactly one"),
    (GEN, {}, 400, None, "exactly one"),
    (GEN, {"input_ids": [1, 2], "return_logprob": True, "logprob_start_len": 3}, 400, "logprob_start_len", "at most"),
    (GEN, _gen(temprature=1), 400, "sampling_params.temprature", "unknown"),
    (GEN, _gen(max_new_tokens=0), 400, "sampling_params.max_new_tokens", None),
    (GEN, _gen(temperature="8"), 400, "sampling_params.temperature", None),
    (GEN, _gen(temperature=5), 400, "sampling_params.temperature", None),
    (GEN, _gen(top_k=2**63), 400, "sampling_params.top_k", None),  # killed the server once
    (GEN, _gen(top_k=2**64 + 1), 400, "sampling_params.top_k", None),
    (GEN, _gen(min_new_tokens=2**63), 400, "sampling_params.min_new_tokens", None),
    (GEN, _gen(min_new_tokens=9, max_new_tokens=3), 400, "sampling_params.min_new_tokens", None),
    (GEN, _gen(stop=["s"] * 100_000), 400, "sampling_params.stop", "at most 16"),
    (GEN, _gen(stop=[""]), 400, "sampling_params.stop", "empty"),
    (GEN, _gen(stop=5), 400, "sampling_params.stop", None),
    (GEN, _gen(logit_bias={"x": 1}), 400, "sampling_params.logit_bias", None),
    (GEN, _gen(logprobs=50), 400, "sampling_params.logprobs", None),
    (GEN, _gen(stop_token_ids=[600]), 400, "sampling_params.stop_token_ids", "outside the vocabulary"),
    (GEN, {"text": "hi", "sampling_params": "x"}, 400, "sampling_params", None),
    (GEN, {"input_ids": [1, 99999]}, 400, "input_ids", "outside the vocabulary"),
    (GEN, {"input_ids": ["1"]}, 400, "input_ids.0", None),
    (GEN, {"input_ids": []}, 400, "input_ids", "empty"),
    (GEN, {"text": "hi", "rid": 5}, 400, "rid", None),
    (GEN, {"text": "hi", "rid": "a\nforged log line"}, 400, "rid", None),
    (GEN, _gen(json_schema='{"type": "string", "pattern": "(?=a)b"}'), 400, "sampling_params.json_schema",
     "lookahead"),
    (GEN, {"text": "hi", "rid": "r" * 300}, 400, "rid", None),
    (GEN, {"text": "hi", "stream": "yes"}, 400, "stream", None),
    (GEN, b'{"text": "\\ud800"}', 400, None, "surrogate"),
    (GEN, b'{"text": "hi", "sampling_params": ' + b'{"a":' * 3000 + b"1" + b"}" * 3000 + b"}", 400, None, None),
    # -- priority: only with --schedule-policy priority (the session server is fcfs), in range
    (CHAT, _chat(priority=1), 400, "priority", "--schedule-policy priority"),
    (CHAT, _chat(priority=2**31), 400, "priority", None),
    (COMP, {"prompt": "Once", "priority": "high"}, 400, "priority", None),
    (GEN, {"text": "Once", "priority": -1}, 400, "priority", "--schedule-policy priority"),
    (MSGS, _msgs(priority=1), 400, "priority", "--schedule-policy priority"),
    (RESP, _resp(priority=1), 400, "priority", "--schedule-policy priority"),
    # -- Anthropic's Messages API
    (MSGS, {"messages": MSG}, 400, "max_tokens", "missing"),
    (MSGS, _msgs(max_tokens=0), 400, "max_tokens", None),
    (MSGS, _msgs(max_tokens=10**6), 400, "max_tokens", "maximum context length"),
    (MSGS, _msgs(messages=[]), 400, "messages", None),
    (MSGS, _msgs(messages=[{"role": "user", "content": [{"type": "image", "source": {}}]}]), 400,
     "messages.0.content", "not supported"),
    (MSGS, _msgs(messages=[{"role": "user", "content": []}]), 400, "messages.0.content", "empty"),
    (MSGS, _msgs(messages=[{"role": "system", "content": "hi"}]), 400, "messages.0.role", None),
    (MSGS, _msgs(messages=[{"role": "assistant", "content": "Hi"}]), 400, "messages", "last message"),
    (MSGS, _msgs(messages=[{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]),
     400, "messages.0", "user message"),
    (MSGS, _msgs(model="claude-opus-4-5"), 404, "model", "does not exist"),
    (MSGS, _msgs(top_q=1), 400, "top_q", None),
    (MSGS, _msgs(temperature=-1), 400, "temperature", None),
    (MSGS, _msgs(stop_sequences=[""]), 400, "stop_sequences.0", None),
    (MSGS, _msgs(stop_sequences=["x"] * 17), 400, "stop_sequences", "at most 16"),
    (MSGS, _msgs(tools=[{"name": "f", "input_schema": {"type": "array"}}]), 400, "tools.0.input_schema", "object"),
    (MSGS, _msgs(tools=[{"name": "f", "input_schema": _SCHEMA}]), 400, "tools.0.input_schema", None),
    (MSGS, _msgs(tools=[{"name": "f", "input_schema": {"type": "object"}}], tool_choice={"type": "tool", "name": "g"}),
     400, "tool_choice", "names no tool"),
    (MSGS, _msgs(tool_choice={"type": "any"}), 400, "tool_choice", "needs tools"),
    (MSGS, _msgs(thinking={"type": "enabled", "budget_tokens": 2048}), 400, "thinking", "--reasoning-parser"),
    (MSGS, _msgs(thinking={"type": "enabled"}), 400, "thinking", "budget_tokens"),
    (MSGS, _msgs(output_config={"format": {"type": "json_schema", "schema": _SCHEMA}}), 400,
     "output_config.format.schema", None),
    (MSGS, _msgs(output_config={"effort": "high"}), 400, "output_config.effort", None),
    (MSGS, b'{"max_tokens": 4, "messages": [', 400, None, None),
    # -- OpenAI's Responses API
    (RESP, {"max_output_tokens": 8}, 400, "input", "missing"),
    (RESP, _resp(input=[]), 400, "input", "empty"),
    (RESP, _resp(input=[{"type": "input_image", "image_url": "x"}]), 400, "input", "not supported"),
    (RESP, _resp(input=[{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]), 400,
     "input.0.message.content", "not supported"),
    (RESP, _resp(input=[{"type": "function_call_output", "output": "x"}]), 400, "input.0.function_call_output.call_id",
     "missing"),
    (RESP, _resp(max_tokens=5), 400, "max_tokens", None),
    (RESP, _resp(max_output_tokens=10**6), 400, "max_output_tokens", "maximum context length"),
    (RESP, _resp(model="gpt-5"), 404, "model", "does not exist"),
    (RESP, _resp(temperature=3), 400, "temperature", None),
    (RESP, _resp(previous_response_id="resp_nope"), 404, "previous_response_id", "not found"),
    (RESP, _resp(tools=[{"type": "function", "name": "f", "parameters": _SCHEMA}]), 400, "tools.0.parameters", None),
    (RESP, _resp(tools=[{"type": "web_search"}]), 400, "tools.0.type", None),
    (RESP, _resp(tool_choice="required"), 400, "tool_choice", "needs tools"),
    (RESP, _resp(text={"format": {"type": "json_schema", "name": "x", "schema": _SCHEMA}}), 400, "text.format.schema",
     None),
    (RESP, _resp(text={"format": {"type": "json_schema", "name": "x"}}), 400, "text.format", "schema is required"),
    (RESP, _resp(reasoning={"effort": "high"}), 400, "reasoning.effort", None),
    (RESP, _resp(include=["message.output_text.logprobs"]), 400, "include.0", None),
    (RESP, _resp(background=True, store=False), 400, None, "must be stored"),
    (RESP, _resp(truncation="auto"), 400, "truncation", None),
    (GEN, {"text": "Once", "lora_path": "no-such-adapter"}, 404, "lora_path", "does not exist"),
    # -- embeddings
    (EMB, {"model": "stories260K"}, 400, "input", "missing"),
    (EMB, {"input": ""}, 400, "input", "must not be empty"),
    (EMB, {"input": []}, 400, "input", "must not be empty"),
    (EMB, {"input": ["a", ""]}, 400, "input", "must not be empty"),
    (EMB, {"input": [[1, 2], []]}, 400, "input", "must not be empty"),
    (EMB, {"input": 5}, 400, "input", None),
    (EMB, {"input": [[1, "a"]]}, 400, "input.0.1", "valid integer"),
    (EMB, {"input": [1, 99999]}, 400, "input", "vocabulary"),
    (EMB, {"input": ["a"] * 257}, 400, "input", "at most 256"),
    (EMB, {"input": [1] * 600}, 400, "input", "context length"),
    (EMB, {"input": "a", "dimensions": 0}, 400, "dimensions", None),
    (EMB, {"input": "a", "dimensions": 65}, 400, "dimensions", "more than the model's 64"),
    (EMB, {"input": "a", "encoding_format": "hex"}, 400, "encoding_format", None),
    (EMB, {"input": "a", "model": "text-embedding-3-small"}, 404, "model", "does not exist"),
    (EMB, {"input": "a", "stream": True}, 400, "stream", None),
    (EMB, {"input": "a", "priority": 1}, 400, "priority", "--schedule-policy priority"),
    (EMB, {"input": "a", "user": 7}, 400, "user", None),
]
