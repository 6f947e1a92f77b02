"""OpenAI Responses API request models (pydantic), strict like the chat ones: an unknown field,
item type or value is a 400 naming it. `ResponsesRequest.to_chat` gives the chat request it
means, after the stored conversation it continues (`previous_response_id`)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

from batonlm.server.protocol import ChatCompletionRequest, Priority, _Strict, ranged

ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")


class InputText(_Strict):
    type: Literal["input_text", "output_text"]  # output_text: an earlier answer given back
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class MessageItem(_Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[InputText]
    id: str | None = None
    status: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts(cls, v: Any) -> Any:
        for part in v if isinstance(v, list) else []:
            kind = part.get("type") if isinstance(part, dict) else None
            if isinstance(kind, str) and kind not in ("input_text", "output_text"):
                raise ValueError(f"content parts of type {kind!r} are not supported (only input_text, output_text)")
        return v

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class FunctionCallItem(_Strict):
    """A call an earlier response made (given back with its output)."""

    type: Literal["function_call"]
    call_id: Annotated[str, Field(min_length=1)]
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(_Strict):
    type: Literal["function_call_output"]
    call_id: Annotated[str, Field(min_length=1)]
    output: str | list[InputText]
    id: str | None = None
    status: str | None = None

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(p.text for p in self.output)


class ReasoningItem(_Strict):
    """An earlier response's reasoning: not rendered again (chat templates drop past reasoning)."""

    model_config = ConfigDict(extra="allow", strict=True)
    type: Literal["reasoning"]


InputItem = Annotated[MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem,
                      Field(discriminator="type")]


class FunctionTool(_Strict):
    type: Literal["function"]
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunction(_Strict):
    type: Literal["function"]
    name: str


class TextFormat(_Strict):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema_iff_json_schema(self) -> TextFormat:
        if (self.type == "json_schema") != (self.schema_ is not None):
            raise ValueError("schema is required with type json_schema, and only there")
        return self


class TextConfig(_Strict):
    format: TextFormat | None = None
    verbosity: Literal["medium"] | None = None  # the only one a model without the setting has


class Reasoning(_Strict):
    """Reasoning comes from --reasoning-parser; how much the model thinks is its own."""

    effort: None = None
    summary: None = None
    generate_summary: None = None


class ResponsesInput(_Strict):
    """What a prompt is made of: also POST /v1/responses/input_tokens' body."""

    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    previous_response_id: str | None = None

    @field_validator("input", mode="before")
    @classmethod
    def _known_items(cls, v: Any) -> Any:
        if isinstance(v, list):
            if not v:
                raise ValueError("must not be empty")
            for item in v:
                if isinstance(item, dict) and "type" not in item and "role" in item:
                    item["type"] = "message"  # the easy form: {"role", "content"}
                kind = item.get("type") if isinstance(item, dict) else None
                if isinstance(kind, str) and kind not in ITEM_TYPES:
                    raise ValueError(f"input items of type {kind!r} are not supported (only {', '.join(ITEM_TYPES)})")
        return v

    @field_validator("tools")
    @classmethod
    def _unique_names(cls, v: list[FunctionTool] | None) -> list[FunctionTool] | None:
        seen: set[str] = set()
        for t in v or []:
            if t.name in seen:
                raise ValueError(f"two tools are named {t.name!r}")
            seen.add(t.name)
        return v

    @field_validator("tool_choice")
    @classmethod
    def _choice_names_a_tool(cls, v: Any, info: Any) -> Any:
        tools = info.data.get("tools") or []
        if v not in (None, "none", "auto") and not tools:
            raise ValueError("needs tools")
        if isinstance(v, NamedFunction) and v.name not in {t.name for t in tools}:
            raise ValueError(f"names no tool of this request: {v.name!r}")
        return v

    def input_messages(self) -> list[dict[str, Any]]:
        """This request's input as chat messages (without the instructions)."""
        items = [MessageItem(role="user", content=self.input)] if isinstance(self.input, str) else self.input
        out: list[dict[str, Any]] = []
        for item in items:
            if isinstance(item, MessageItem):
                out.append({"role": item.role, "content": item.text()})
            elif isinstance(item, FunctionCallItem):
                call = {"id": item.call_id, "type": "function",
                        "function": {"name": item.name, "arguments": item.arguments}}
                if out and out[-1]["role"] == "assistant":
                    out[-1].setdefault("tool_calls", []).append(call)  # parallel calls: one assistant turn
                else:
                    out.append({"role": "assistant", "content": None, "tool_calls": [call]})
            elif isinstance(item, FunctionCallOutputItem):
                out.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
        return out

    def chat_fields(self, history: list[dict[str, Any]]) -> dict[str, Any]:
        """The chat request's messages (instructions, the stored history, this input), tools
        and tool_choice (as JSON would give them)."""
        system = [{"role": "system", "content": self.instructions}] if self.instructions is not None else []
        out: dict[str, Any] = {"messages": system + history + self.input_messages()}
        if self.tools:
            out["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                            for t in self.tools]
            choice = self.tool_choice
            if choice is not None:
                out["tool_choice"] = ({"type": "function", "function": {"name": choice.name}}
                                      if isinstance(choice, NamedFunction) else choice)
            if self.parallel_tool_calls is not None:
                out["parallel_tool_calls"] = self.parallel_tool_calls
        return out


class ResponsesRequest(ResponsesInput):
    """POST /v1/responses."""

    max_output_tokens: Annotated[int, ranged("max_new_tokens")] | None = None
    temperature: Annotated[float, ranged("temperature")] | None = None
    top_p: Annotated[float, ranged("top_p")] | None = None
    text: TextConfig | None = None
    reasoning: Reasoning | None = None
    stream: bool = False
    store: bool = True
    background: bool = False
    include: list[Literal["reasoning.encrypted_content"]] | None = None  # reasoning is never encrypted here: none
    metadata: dict[str, Annotated[str, Field(max_length=512)]] | None = Field(default=None, max_length=16)
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    truncation: Literal["disabled"] | None = None
    service_tier: Literal["auto", "default"] | None = None
    priority: Priority = 0  # batonlm's (and vLLM's): --schedule-policy priority

    @model_validator(mode="after")
    def _background_is_stored(self) -> ResponsesRequest:
        if self.background and not self.store:
            raise ValueError("background responses must be stored (store: true)")
        if self.background and self.stream:
            raise ValueError("a background response is not streamed here: poll GET /v1/responses/{id}")
        return self

    def to_chat(self, history: list[dict[str, Any]]) -> ChatCompletionRequest:
        fields: dict[str, Any] = {**self.chat_fields(history), "stream": self.stream, "priority": self.priority}
        for name, value in (("max_tokens", self.max_output_tokens), ("temperature", self.temperature),
                            ("top_p", self.top_p)):
            if value is not None:
                fields[name] = value
        fmt = self.text.format if self.text is not None else None
        if self.tools and self.tool_choice not in (None, "none", "auto"):
            fmt = None  # a turn forced to call tools writes no text for the format to shape (agents send both)
        if fmt is not None and fmt.type == "json_object":
            fields["response_format"] = {"type": "json_object"}
        elif fmt is not None and fmt.type == "json_schema":
            fields["response_format"] = {"type": "json_schema", "json_schema": {
                "name": fmt.name or "response", "schema": fmt.schema_}}
        return ChatCompletionRequest.model_validate(fields)


class InputTokensRequest(ResponsesInput):
    """POST /v1/responses/input_tokens: the prompt a response with these fields would have."""
