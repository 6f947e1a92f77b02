"""The shapes of what the server answers, for its OpenAPI description (the handlers build the
same dicts; the schemathesis test checks every answer against these)."""

from __future__ import annotations

from typing import Literal

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


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


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
