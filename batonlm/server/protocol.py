"""OpenAI-compatible request models (pydantic). Unknown fields are rejected, never ignored, and
types are strict (a number sent as a string is an error). Value ranges of sampling fields come
from `SamplingParams`, where they are stated once (`ranged`)."""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from batonlm.sampling_params import field_range

# A request's priority (--schedule-policy priority): lower values first, vLLM's convention.
Priority = Annotated[int, Field(ge=-(2**31), le=2**31 - 1)]


def ranged(sampling_field: str) -> Any:
    """A pydantic Field with the bounds SamplingParams states for `sampling_field`."""
    return Field(**field_range(sampling_field))


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False  # a last chunk with the usage (OpenAI)
    continuous_usage_stats: bool = False  # every chunk with the usage so far (vLLM)


class FunctionCallIn(_Strict):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCallIn(_Strict):
    """A call an earlier assistant message made (it comes back in the conversation)."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None  # assistant messages only
    tool_call_id: str | None = None  # tool messages only: the call this result answers

    @model_validator(mode="after")
    def _tool_fields(self) -> ChatMessage:
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("only assistant messages have tool_calls")
        if (self.role == "tool") != (self.tool_call_id is not None):
            raise ValueError("tool messages, and only they, need tool_call_id")
        return self

    def template_dict(self) -> dict[str, Any]:
        """The message as chat templates read it (tool-call arguments as objects where they parse)."""
        out: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.tool_calls:
            out["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.function.name, "arguments": _json_or_text(c.function.arguments)}} for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            out["name"] = self.name
        return out

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts(cls, v):
        """Content parts are joined; only text parts are supported."""
        if not isinstance(v, list):
            return v
        texts = []
        for part in v:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ValueError(f"only text content parts are supported, got {kind!r}")
            if set(part) - {"type", "text"}:
                raise ValueError(f"unknown content part fields {sorted(set(part) - {'type', 'text'})}")
            texts.append(part["text"])
        return "".join(texts)

    def text(self) -> str:
        return self.content or ""


def _json_or_text(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


class FunctionDef(_Strict):
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; None: no arguments
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(_Strict):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)

    name: Annotated[str, Field(max_length=64)] = "response"
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    """OpenAI's response_format: text, any JSON object, or JSON following a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_iff_json_schema(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is required with type json_schema, and only there")
        return self


class SamplingFields(_Strict):
    """Fields shared by chat and text completions."""

    model: str | None = None
    max_tokens: Annotated[int, ranged("max_new_tokens")] | None = None
    max_completion_tokens: Annotated[int, ranged("max_new_tokens")] | None = None
    temperature: Annotated[float, ranged("temperature")] = 1.0
    top_p: Annotated[float, ranged("top_p")] = 1.0
    top_k: Annotated[int, ranged("top_k")] = -1
    min_p: Annotated[float, ranged("min_p")] = 0.0
    n: Annotated[int, Field(ge=1)] = 1
    stop: str | list[str] | None = None
    stop_token_ids: list[Annotated[int, ranged("stop_token_ids")]] | None = None
    seed: Annotated[int, ranged("seed")] | None = None
    frequency_penalty: Annotated[float, ranged("frequency_penalty")] = 0.0
    presence_penalty: Annotated[float, ranged("presence_penalty")] = 0.0
    repetition_penalty: Annotated[float, ranged("repetition_penalty")] = 1.0
    logit_bias: dict[str, Annotated[float, ranged("logit_bias")]] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    min_tokens: Annotated[int, ranged("min_new_tokens")] = 0
    user: str | None = None
    # Constrained output (at most one): OpenAI's response_format, or SGLang's regex / ebnf.
    response_format: ResponseFormat | None = None
    regex: str | None = None
    ebnf: str | None = None
    priority: Priority = 0

    @property
    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @field_validator("stop")
    @classmethod
    def _stop_not_empty(cls, v: str | list[str] | None) -> str | list[str] | None:
        if v is not None and not all([v] if isinstance(v, str) else v):
            raise ValueError("stop strings must not be empty")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        # JSON keys are strings: token ids as decimal strings.
        for key in v or {}:
            if not re.fullmatch(r"[0-9]{1,10}", key):
                raise ValueError(f"keys must be token ids, got {key!r}")
        return v

    @field_validator("stream_options")
    @classmethod
    def _stream_options(cls, v, info):
        if v is not None and not info.data.get("stream"):
            raise ValueError("only allowed when stream is true")
        return v

    @field_validator("max_completion_tokens")
    @classmethod
    def _max_tokens_agree(cls, v, info):
        other = info.data.get("max_tokens")
        if v is not None and other is not None and v != other:
            raise ValueError(f"disagrees with max_tokens ({other}); give one of them")
        return v

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)

    @property
    def num_logprobs(self) -> int | None:
        """Top logprobs per token to return (None: no logprobs); each request names it its way."""
        raise NotImplementedError


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: Annotated[int, ranged("logprobs")] | None = None
    tools: list[Tool] | None = Field(default=None, min_length=1)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True

    @field_validator("messages")
    @classmethod
    def _content_required(cls, v: list[ChatMessage]) -> list[ChatMessage]:
        for m in v:
            if m.content is None and m.role != "assistant":
                raise ValueError(f"a {m.role} message needs content")
        return v

    @field_validator("tools")
    @classmethod
    def _unique_names(cls, v: list[Tool] | None) -> list[Tool] | None:
        seen: set[str] = set()  # linear: a request may carry tens of thousands of tools
        for t in v or []:
            if t.function.name in seen:
                raise ValueError(f"two tools are named {t.function.name!r}")
            seen.add(t.function.name)
        return v

    @field_validator("tool_choice")
    @classmethod
    def _choice_names_a_tool(cls, v, info):
        tools = info.data.get("tools")
        if v not in (None, "none", "auto") and not tools:
            raise ValueError("needs tools")
        if isinstance(v, NamedToolChoice) and v.function.name not in {t.function.name for t in tools}:
            raise ValueError(f"names no tool of this request: {v.function.name!r}")
        return v

    @property
    def tool_mode(self) -> str:
        """none (no tools, or tool_choice none), auto, required, or named."""
        if not self.tools or self.tool_choice == "none":
            return "none"
        if isinstance(self.tool_choice, NamedToolChoice):
            return "named"
        return self.tool_choice or "auto"

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_needs_logprobs(cls, v, info):
        if v is not None and not info.data.get("logprobs"):
            raise ValueError("requires logprobs to be true")
        return v

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    logprobs_field: ClassVar[str] = "top_logprobs"


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    # 0 (with echo): score the prompt only (its logprobs with `logprobs`), complete nothing.
    max_tokens: Annotated[int, Field(ge=0, le=field_range("max_new_tokens")["le"])] | None = None
    logprobs: Annotated[int, ranged("logprobs")] | None = None
    echo: bool = False
    suffix: None = None

    @field_validator("prompt")
    @classmethod
    def _prompt_not_empty(cls, v):
        if isinstance(v, list) and len(v) == 0:
            raise ValueError("must not be empty")
        if isinstance(v, list) and any(isinstance(p, list) and len(p) == 0 for p in v):
            raise ValueError("token-id prompts must not be empty")
        return v

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs

    logprobs_field: ClassVar[str] = "logprobs"


class NativeGenerateRequest(_Strict):
    """POST /generate: SGLang-style native API."""

    # One prompt, or a batch of them (SGLang's: the answer is then a list, prompt-major).
    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict | None = None
    stream: bool = False
    # Visible ASCII only: a request id goes into log lines, where a newline would forge one.
    rid: Annotated[str, Field(pattern=r"^[!-~]{1,256}$")] | None = None
    # SGLang's logprob fields: the output tokens' logprobs, and with logprob_start_len >= 0 the
    # prompt's from that position on; top_logprobs_num alternatives; the tokens' text too.
    return_logprob: bool = False
    logprob_start_len: Annotated[int, Field(ge=-1, le=field_range("logprob_start_len")["le"])] = -1
    top_logprobs_num: Annotated[int, ranged("logprobs")] = 0
    return_text_in_logprobs: bool = False
    priority: Priority = 0
    lora_path: str | None = None  # SGLang's: the LoRA adapter's name (--lora-paths)

    @model_validator(mode="after")
    def _one_input(self) -> NativeGenerateRequest:
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("give exactly one of text and input_ids")
        if isinstance(self.text, list) and not self.text:
            raise ValueError("text: a batch of prompts must not be empty")
        if self.input_ids and isinstance(self.input_ids[0], list) and not all(self.input_ids):
            raise ValueError("input_ids: token-id prompts must not be empty")
        return self

    @property
    def prompts(self) -> list[str] | list[list[int]]:
        if self.text is not None:
            return [self.text] if isinstance(self.text, str) else self.text
        ids = self.input_ids or []
        return ids if ids and isinstance(ids[0], list) else [ids]

    @property
    def batched(self) -> bool:
        return isinstance(self.text, list) or bool(self.input_ids and isinstance(self.input_ids[0], list))


class EmbeddingRequest(_Strict):
    """POST /v1/embeddings (OpenAI's shape): a text, texts, token ids, or lists of token ids."""

    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    # Matryoshka: the first `dimensions` values, normalised again.
    dimensions: Annotated[int, Field(ge=1)] | None = None
    user: str | None = None
    priority: Priority = 0

    @field_validator("input")
    @classmethod
    def _input_not_empty(cls, v):
        if isinstance(v, str | list) and len(v) == 0:
            raise ValueError("must not be empty")
        if isinstance(v, list) and any(isinstance(p, str | list) and len(p) == 0 for p in v):
            raise ValueError("an input must not be empty")
        return v


class TokenizeRequest(_Strict):
    """POST /tokenize (vLLM's shape): a prompt, or chat messages through the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_special_tokens: bool = True  # prompts only: the template writes its own
    add_generation_prompt: bool = True  # messages only
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        return self


class DetokenizeRequest(_Strict):
    """POST /detokenize (vLLM's shape)."""

    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0)]]
