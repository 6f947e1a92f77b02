"""The shapes of what the server answers, for its OpenAPI description (the handlers build the
same dicts; the schemathesis test checks every answer against these)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel

FinishReason = Literal["stop", "length", "abort", "tool_calls"] | None


class PromptTokensDetails(BaseModel):
    cached_tokens: int  # prompt tokens whose KV the prefix cache served


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprobEntry(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprobEntry]
    refusal: None


class FunctionCallOut(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"]
    function: FunctionCallOut


class ChatMessageOut(BaseModel):
    role: Literal["assistant"]
    content: str | None  # None when the message is only tool calls
    tool_calls: list[ToolCallOut] | None = None
    reasoning_content: str | None = None  # with --reasoning-parser


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason


class ChatCompletion(BaseModel):
    """Streamed (`stream: true`), the same arrives as `chat.completion.chunk` server-sent events."""

    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class CompletionLogprobs(BaseModel):
    """With `echo`, the prompt's tokens come first; the very first has null logprobs."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: FinishReason


class Completion(BaseModel):
    """Streamed (`stream: true`), the same arrives as `text_completion` server-sent events."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class GenerateMeta(BaseModel):
    id: str
    finish_reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int | None
    preemptions: int  # retractions for requests of higher priority (--schedule-policy priority)
    e2e_latency: float
    # With return_logprob: [logprob, token id, text (return_text_in_logprobs) or null] per
    # token; the top lists with top_logprobs_num > 0 (null for the first prompt token).
    input_token_logprobs: list[tuple[float | None, int, str | None]] | None = None
    output_token_logprobs: list[tuple[float | None, int, str | None]] | None = None
    input_top_logprobs: list[list[tuple[float, int, str | None]] | None] | None = None
    output_top_logprobs: list[list[tuple[float, int, str | None]] | None] | None = None
    # With speculative decoding, once finished: verification steps, drafts accepted, and the
    # tokens per verification step (accepted drafts + 1).
    spec_verify_ct: int | None = None
    spec_accepted_drafts: int | None = None
    spec_accept_length: float | None = None


class GenerateResponse(BaseModel):
    text: str
    output_ids: list[int]
    meta_info: GenerateMeta


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str
    max_model_len: int | None
    parent: str | None = None  # a LoRA adapter's base model


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class Embedding(BaseModel):
    object: Literal["embedding"]
    index: int
    embedding: list[float] | str  # floats, or base64 of little-endian float32 (encoding_format)


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingList(BaseModel):
    object: Literal["list"]
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage


class DetokenizeResponse(BaseModel):
    prompt: str


class TokenizerInfo(BaseModel):
    tokenizer_class: str
    eos_token: str | None
    bos_token: str | None
    pad_token: str | None
    unk_token: str | None
    chat_template: str | None
    model_max_length: int | None


class Version(BaseModel):
    version: str


class Health(BaseModel):
    status: Literal["ok", "unhealthy", "shutting_down"]
    reason: str | None = None


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None
    request_id: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


# ---------------------------------------------------------------- Anthropic's Messages API
class AnthropicTextBlock(BaseModel):
    type: Literal["text"]
    text: str


class AnthropicThinkingBlock(BaseModel):
    type: Literal["thinking"]
    thinking: str  # what --reasoning-parser split off
    signature: str  # always empty: the thinking is not signed


class AnthropicToolUseBlock(BaseModel):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class AnthropicUsage(BaseModel):
    input_tokens: int  # the prompt's tokens the prefix cache did not serve
    output_tokens: int
    cache_read_input_tokens: int  # those it served
    cache_creation_input_tokens: int


class AnthropicMessage(BaseModel):
    """Streamed (`stream: true`), the same arrives as Anthropic's named events: message_start,
    content_block_start / _delta / _stop per block, message_delta, message_stop (and ping)."""

    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    model: str
    content: list[AnthropicTextBlock | AnthropicThinkingBlock | AnthropicToolUseBlock]
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"] | None
    stop_sequence: str | None
    usage: AnthropicUsage


class MessageTokenCount(BaseModel):
    input_tokens: int


class AnthropicErrorDetail(BaseModel):
    type: str
    message: str  # names the field at fault


class AnthropicErrorResponse(BaseModel):
    type: Literal["error"]
    error: AnthropicErrorDetail
    request_id: str | None = None


# ---------------------------------------------------------------- OpenAI's Responses API
class OutputText(BaseModel):
    type: Literal["output_text"]
    text: str
    annotations: list[Any]
    logprobs: list[Any]


class ReasoningText(BaseModel):
    type: Literal["reasoning_text"]
    text: str


ItemStatus = Literal["in_progress", "completed", "incomplete"]


class ResponseMessageItem(BaseModel):
    type: Literal["message"]
    id: str
    status: ItemStatus
    role: Literal["assistant"]
    content: list[OutputText]


class ResponseReasoningItem(BaseModel):
    type: Literal["reasoning"]
    id: str
    summary: list[Any]
    content: list[ReasoningText]  # what --reasoning-parser split off
    status: ItemStatus


class ResponseFunctionCallItem(BaseModel):
    type: Literal["function_call"]
    id: str
    call_id: str
    name: str
    arguments: str  # JSON text
    status: ItemStatus


class InputTokensDetails(BaseModel):
    cached_tokens: int


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class ResponseObject(BaseModel):
    """Streamed (`stream: true`), its typed events arrive instead (response.created, ...,
    response.completed or response.incomplete), each with a sequence_number."""

    id: str
    object: Literal["response"]
    created_at: int
    status: Literal["queued", "in_progress", "completed", "incomplete", "cancelled", "failed"]
    background: bool
    error: dict[str, Any] | None
    incomplete_details: dict[str, Any] | None
    instructions: str | None
    max_output_tokens: int | None
    model: str
    output: list[ResponseMessageItem | ResponseReasoningItem | ResponseFunctionCallItem]
    parallel_tool_calls: bool
    previous_response_id: str | None
    reasoning: dict[str, Any]
    store: bool
    temperature: float
    text: dict[str, Any]
    tool_choice: Any
    tools: list[dict[str, Any]]
    top_p: float
    truncation: Literal["disabled"]
    usage: ResponseUsage | None
    metadata: dict[str, str]
    user: str | None


class DeletedResponse(BaseModel):
    id: str
    object: Literal["response"]
    deleted: bool


class InputTokenCount(BaseModel):
    object: Literal["response.input_tokens"]
    input_tokens: int


class InputItemList(BaseModel):
    object: Literal["list"]
    data: list[dict[str, Any]]
    first_id: str | None
    last_id: str | None
    has_more: bool
