"""Anthropic Messages API request models (pydantic), strict like the OpenAI ones: an unknown
field, block type or value is a 400 naming it, never ignored. `to_chat` turns a request into the
chat request the chat route's machinery (template, tools, constraint, sampling) takes."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from batonlm.server.protocol import ChatCompletionRequest, Priority, _Strict, ranged

# The content blocks a request may carry; others (image, document, search_result, ...) are refused.
BLOCK_TYPES = ("text", "tool_use", "tool_result", "thinking", "redacted_thinking")


class CacheControl(_Strict):
    """Accepted and not needed: the prefix cache reuses any prompt's prefix by itself."""

    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class TextBlock(_Strict):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None
    citations: None = None


class ToolUseBlock(_Strict):
    """A call an earlier assistant turn made."""

    type: Literal["tool_use"]
    id: Annotated[str, Field(min_length=1)]
    name: str
    input: dict[str, Any]
    cache_control: CacheControl | None = None


class ToolResultBlock(_Strict):
    """A call's result, in a user turn."""

    type: Literal["tool_result"]
    tool_use_id: Annotated[str, Field(min_length=1)]
    content: str | list[TextBlock] = ""
    is_error: bool = False
    cache_control: CacheControl | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(b.text for b in self.content)


class ThinkingBlock(_Strict):
    """An earlier turn's thinking: not rendered again (chat templates drop past reasoning)."""

    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(_Strict):
    type: Literal["redacted_thinking"]
    data: str


Block = Annotated[TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock,
                  Field(discriminator="type")]


class Message(_Strict):
    role: Literal["user", "assistant"]
    content: str | list[Block]

    @field_validator("content", mode="before")
    @classmethod
    def _known_blocks(cls, v: Any) -> Any:
        if isinstance(v, list):
            if not v:
                raise ValueError("must not be empty")
            for block in v:
                kind = block.get("type") if isinstance(block, dict) else None
                if isinstance(kind, str) and kind not in BLOCK_TYPES:
                    raise ValueError(f"content blocks of type {kind!r} are not supported (only {', '.join(BLOCK_TYPES)})")
        return v

    @model_validator(mode="after")
    def _blocks_of_role(self) -> Message:
        kinds = {b.type for b in self.content} if isinstance(self.content, list) else set()
        if self.role == "user" and kinds & {"tool_use", "thinking", "redacted_thinking"}:
            raise ValueError("a user message holds text and tool_result blocks only")
        if self.role == "assistant" and "tool_result" in kinds:
            raise ValueError("tool_result blocks belong in user messages")
        return self


class Tool(_Strict):
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    cache_control: CacheControl | None = None

    @field_validator("input_schema")
    @classmethod
    def _an_object(cls, v: dict[str, Any]) -> dict[str, Any]:
        if v.get("type") != "object":
            raise ValueError('must be a JSON schema of type "object"')
        return v


class ToolChoice(_Strict):
    """auto (the model decides), any (at least one call), tool (that one), none."""

    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False

    @model_validator(mode="after")
    def _name_iff_tool(self) -> ToolChoice:
        if (self.type == "tool") != (self.name is not None):
            raise ValueError("name is required with type tool, and only there")
        return self


class Thinking(_Strict):
    """Extended thinking: the model's reasoning, split off by --reasoning-parser, comes back as
    thinking blocks. `budget_tokens` is bounded as Anthropic bounds it; the thinking counts
    toward max_tokens, which is the only cap on it here."""

    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: Annotated[int, Field(ge=1024)] | None = None
    display: Literal["summarized", "omitted"] | None = None

    @model_validator(mode="after")
    def _budget_iff_enabled(self) -> Thinking:
        if (self.type == "enabled") != (self.budget_tokens is not None):
            raise ValueError("budget_tokens is required with type enabled, and only there")
        return self


class JsonOutputFormat(_Strict):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Strict):
    """Structured output: the answer's text follows the JSON schema (constrained decoding)."""

    format: JsonOutputFormat | None = None


class Metadata(_Strict):
    user_id: str | None = None


class MessagesInput(_Strict):
    """What a prompt is made of: also POST /v1/messages/count_tokens' body."""

    model: str | None = None
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None

    @field_validator("messages")
    @classmethod
    def _ends_with_user(cls, v: list[Message]) -> list[Message]:
        if v[-1].role != "user":
            raise ValueError("the last message must be a user message (continuing an assistant turn is not supported)")
        return v

    @field_validator("tools")
    @classmethod
    def _unique_names(cls, v: list[Tool] | None) -> list[Tool] | None:
        seen: set[str] = set()
        for t in v or []:
            if t.name in seen:
                raise ValueError(f"two tools are named {t.name!r}")
            seen.add(t.name)
        return v

    @field_validator("tool_choice")
    @classmethod
    def _choice_names_a_tool(cls, v: ToolChoice | None, info: Any) -> ToolChoice | None:
        tools = info.data.get("tools") or []
        if v is not None and v.type in ("any", "tool") and not tools:
            raise ValueError("needs tools")
        if v is not None and v.type == "tool" and v.name not in {t.name for t in tools}:
            raise ValueError(f"names no tool of this request: {v.name!r}")
        return v

    def chat_fields(self) -> dict[str, Any]:
        """The chat request's messages, tools and tool_choice (as JSON would give them)."""
        out: dict[str, Any] = {"messages": _chat_messages(self.system, self.messages)}
        if self.tools:
            out["tools"] = [{"type": "function", "function": {
                "name": t.name, "parameters": t.input_schema,
                **({"description": t.description} if t.description is not None else {})}} for t in self.tools]
        choice = self.tool_choice
        if choice is not None and self.tools:
            out["tool_choice"] = ({"type": "function", "function": {"name": choice.name}} if choice.type == "tool"
                                  else {"auto": "auto", "any": "required", "none": "none"}[choice.type])
            out["parallel_tool_calls"] = not choice.disable_parallel_tool_use
        return out


class MessagesRequest(MessagesInput):
    """POST /v1/messages."""

    max_tokens: Annotated[int, ranged("max_new_tokens")]
    stop_sequences: list[Annotated[str, Field(min_length=1)]] | None = None
    temperature: Annotated[float, ranged("temperature")] = 1.0
    top_p: Annotated[float, ranged("top_p")] = 1.0
    top_k: Annotated[int, ranged("top_k")] = -1
    stream: bool = False
    metadata: Metadata | None = None
    output_config: OutputConfig | None = None
    service_tier: Literal["auto", "standard_only"] | None = None
    priority: Priority = 0  # batonlm's (and vLLM's): --schedule-policy priority

    @model_validator(mode="after")
    def _format_or_forced_tools(self) -> MessagesRequest:
        forced = self.tool_choice is not None and self.tool_choice.type in ("any", "tool")
        if forced and self.output_config is not None and self.output_config.format is not None:
            raise ValueError("output_config.format cannot be combined with tool_choice any or tool")
        return self

    def to_chat(self) -> ChatCompletionRequest:
        """The chat request this one means (its fields already checked here)."""
        fields: dict[str, Any] = {
            **self.chat_fields(), "max_tokens": self.max_tokens, "temperature": self.temperature,
            "top_p": self.top_p, "top_k": self.top_k, "stream": self.stream, "priority": self.priority,
        }
        if self.stop_sequences:
            fields["stop"] = list(self.stop_sequences)
        fmt = self.output_config.format if self.output_config is not None else None
        if fmt is not None:
            fields["response_format"] = {"type": "json_schema", "json_schema": {"schema": fmt.schema_}}
        return ChatCompletionRequest.model_validate(fields)


def _text(content: str | list[TextBlock] | None) -> str:
    return content if isinstance(content, str) else "".join(b.text for b in content or [])


def _chat_messages(system: str | list[TextBlock] | None, messages: list[Message]) -> list[dict[str, Any]]:
    """Anthropic's turns as chat messages: the system prompt first, each tool_result a tool
    message (in its place among the user's text), an assistant's tool_use blocks its tool_calls."""
    out: list[dict[str, Any]] = []
    if system:
        out.append({"role": "system", "content": _text(system)})
    for m in messages:
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
            continue
        if m.role == "assistant":
            text = "".join(b.text for b in m.content if isinstance(b, TextBlock))
            calls = [{"id": b.id, "type": "function", "function": {"name": b.name, "arguments": json.dumps(b.input)}}
                     for b in m.content if isinstance(b, ToolUseBlock)]
            out.append({"role": "assistant", "content": text or None, **({"tool_calls": calls} if calls else {})})
            continue
        pending: list[str] = []
        for b in m.content:
            if isinstance(b, ToolResultBlock):
                if pending:
                    out.append({"role": "user", "content": "".join(pending)})
                    pending = []
                out.append({"role": "tool", "tool_call_id": b.tool_use_id,
                            "content": ("Error: " if b.is_error else "") + b.text()})
            elif isinstance(b, TextBlock):
                pending.append(b.text)
        if pending:
            out.append({"role": "user", "content": "".join(pending)})
    return out


class CountTokensRequest(MessagesInput):
    """POST /v1/messages/count_tokens: the prompt a Messages request with these fields would have."""
