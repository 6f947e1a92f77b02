"""One streamed request to an OpenAI-compatible server, timed chunk by chunk on the client.

Every request streams (`stream: true`, `stream_options.include_usage: true`); the SSE body is
read as `data: {json}` lines until `data: [DONE]`. Any failure (connection error, non-200,
an error event mid-stream, a stream cut short, a timeout) is returned as an unsuccessful
`RequestResult` carrying its message, never raised.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from batonlm.bench.datasets import BenchRequest

logger = logging.getLogger(__name__)

ENDPOINTS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
DONE = "[DONE]"


@dataclass(frozen=True)
class Target:
    """Where and how to send requests."""

    base_url: str
    endpoint: str
    model: str
    api_key: str | None = None
    timeout: float = 3600.0

    def __post_init__(self) -> None:
        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"endpoint must be one of {', '.join(ENDPOINTS)}, got {self.endpoint!r}")

    @property
    def url(self) -> str:
        return self.base_url.rstrip("/") + ENDPOINTS[self.endpoint]

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


@dataclass
class RequestResult:
    """What the client saw. Times are seconds; `start_s` is relative to the run's start and
    `chunk_times_s` (one per non-empty content chunk) to the request's own start. `end_s` is
    when the client was done with it, failed or not; `e2e_s` is set only on success."""

    index: int
    prompt_len: int
    output_len: int
    group: int | None = None
    scheduled_s: float = 0.0
    start_s: float = 0.0
    end_s: float = 0.0
    e2e_s: float | None = None
    chunk_times_s: list[float] = field(default_factory=list)
    usage_completion_tokens: int | None = None
    server_prompt_tokens: int | None = None
    success: bool = False
    error: str | None = None

    @property
    def ttft_s(self) -> float | None:
        return self.chunk_times_s[0] if self.chunk_times_s else None

    @property
    def output_tokens(self) -> int:
        """Tokens from the usage chunk when the server sent one, else content chunks counted."""
        if self.usage_completion_tokens is not None:
            return self.usage_completion_tokens
        return len(self.chunk_times_s)


def build_payload(target: Target, req: BenchRequest) -> dict[str, Any]:
    """The request body; `ignore_eos` and `min_tokens` (vLLM/SGLang extensions) hold the length."""
    body: dict[str, Any] = {"model": target.model}
    if target.endpoint == "chat":
        body["messages"] = req.chat_messages()
        body["max_completion_tokens"] = req.output_len
    else:
        body["prompt"] = req.completion_prompt()
        body["max_tokens"] = req.output_len
    body.update(
        min_tokens=req.output_len,
        ignore_eos=True,
        temperature=0.0,
        stream=True,
        stream_options={"include_usage": True},
    )
    return body


def parse_sse_line(line: str) -> str | None:
    """The payload of a `data:` line; None for blank lines, comments and other SSE fields."""
    if not line.startswith("data:"):
        return None
    return line[5:].strip()


def chunk_text(event: dict[str, Any]) -> str:
    """The generated text in one streamed event (completions `text` or chat `delta`)."""
    text = ""
    for choice in event.get("choices") or []:
        if "text" in choice:
            text += choice.get("text") or ""
        delta = choice.get("delta") or {}
        text += (delta.get("content") or "") + (delta.get("reasoning_content") or "")
    return text


def _error_message(event: dict[str, Any]) -> str | None:
    err = event.get("error")
    if err is None:
        return None
    if isinstance(err, dict):
        err = err.get("message") or json.dumps(err)
    return f"error in stream: {err}"


async def _stream(client: httpx.AsyncClient, target: Target, req: BenchRequest, result: RequestResult,
                  t_start: float) -> None:
    async with client.stream("POST", target.url, json=build_payload(target, req), headers=target.headers()) as resp:
        if resp.status_code != 200:
            body = (await resp.aread()).decode(errors="replace").strip()
            result.error = f"HTTP {resp.status_code}: {body[:300]}"
            return
        async for line in resp.aiter_lines():
            data = parse_sse_line(line)
            if not data:
                continue
            now = time.perf_counter()
            if data == DONE:
                result.e2e_s = now - t_start
                break
            try:
                event = json.loads(data)
            except json.JSONDecodeError:
                result.error = f"bad SSE data: {data[:200]}"
                return
            if (message := _error_message(event)) is not None:
                result.error = message
                return
            if chunk_text(event):
                result.chunk_times_s.append(now - t_start)
            usage = event.get("usage")
            if usage:
                result.usage_completion_tokens = usage.get("completion_tokens")
                result.server_prompt_tokens = usage.get("prompt_tokens")
    if result.e2e_s is None:
        result.error = "stream ended without data: [DONE]"
    elif not result.chunk_times_s:
        result.error = "stream finished with no content"
    else:
        result.success = True


async def send_request(client: httpx.AsyncClient, target: Target, req: BenchRequest, t0: float,
                       scheduled_s: float = 0.0) -> RequestResult:
    """Send `req` now and time it; `t0` is the run's start on the perf_counter clock."""
    t_start = time.perf_counter()
    result = RequestResult(req.index, req.prompt_len, req.output_len, req.group, scheduled_s, t_start - t0)
    try:
        await asyncio.wait_for(_stream(client, target, req, result, t_start), target.timeout)
    except asyncio.TimeoutError:
        result.error = f"timeout after {target.timeout:g} s"
    except (httpx.HTTPError, OSError) as e:
        result.error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    result.end_s = time.perf_counter() - t0
    if not result.success:
        result.e2e_s = None
        logger.debug("request %d failed: %s", req.index, result.error)
    return result


async def first_model_id(client: httpx.AsyncClient, base_url: str, api_key: str | None = None) -> str:
    """The first model id listed by GET /v1/models."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    resp = await client.get(base_url.rstrip("/") + "/v1/models", headers=headers)
    resp.raise_for_status()
    models = resp.json().get("data") or []
    if not models:
        raise ValueError(f"{base_url}/v1/models lists no models")
    return models[0]["id"]
