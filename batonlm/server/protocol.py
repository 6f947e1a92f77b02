"""OpenAI-compatible request models (pydantic). Unknown fields are rejected, never ignored."""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, field_validator, model_validator

from batonlm.sampling_params import MAX_TOP_LOGPROBS

MAX_N = 16
MAX_STOP_STRINGS = 16


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    include_usage: StrictBool = False


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | None = None
    name: str | None = None

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


class SamplingFields(_Strict):
    """Fields shared by chat and text completions."""

    model: str | None = None
    max_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    top_k: StrictInt = -1
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] = 0.0
    n: Annotated[StrictInt, Field(ge=1, le=MAX_N)] = 1
    stop: str | list[str] | None = None
    stop_token_ids: list[StrictInt] | None = None
    seed: StrictInt | None = None
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    repetition_penalty: Annotated[float, Field(gt=0.0, le=10.0)] = 1.0
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    ignore_eos: StrictBool = False
    min_tokens: Annotated[StrictInt, Field(ge=0)] = 0
    user: str | None = None

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v: int) -> int:
        if v != -1 and v < 1:
            raise ValueError("must be -1 (disabled) or >= 1")
        return v

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> list[str]:
        stops = [v] if isinstance(v, str) else list(v or [])
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings")
        if any(s == "" for s in stops):
            raise ValueError("stop strings must not be empty")
        return stops

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for key in v or {}:
            if not re.fullmatch(r"-?[0-9]+", key):
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


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: StrictBool = False
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None

    @field_validator("messages")
    @classmethod
    def _content_required(cls, v: list[ChatMessage]) -> list[ChatMessage]:
        for m in v:
            if m.content is None and m.role != "assistant":
                raise ValueError(f"a {m.role} message needs content")
        return v

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_needs_logprobs(cls, v, info):
        if v is not None and not info.data.get("logprobs"):
            raise ValueError("requires logprobs to be true")
        return v

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[StrictInt] | list[list[StrictInt]]
    logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    echo: StrictBool = False
    suffix: None = None

    @field_validator("echo")
    @classmethod
    def _echo_with_logprobs(cls, v, info):
        if v and info.data.get("logprobs") is not None:
            raise ValueError("echo together with logprobs is not supported (prompt logprobs are not computed)")
        return v

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


class NativeGenerateRequest(_Strict):
    """POST /generate: SGLang-style native API."""

    text: str | None = None
    input_ids: list[StrictInt] | None = None
    sampling_params: dict | None = None
    stream: StrictBool = False
    rid: str | None = None

    @model_validator(mode="after")
    def _one_input(self) -> NativeGenerateRequest:
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("give exactly one of text and input_ids")
        return self
