"""What the request handlers share: one object per server instance, kept on `app.state`."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError

from batonlm.config import ServerArgs
from batonlm.server.errors import APIError, bad_request, from_validation_error, model_not_found, unavailable
from batonlm.server.metrics import ServerMetrics
from batonlm.tokenizer_manager.manager import TokenizerManager
from batonlm.tokenizer_manager.token_bytes import TokenBytes

M = TypeVar("M", bound=BaseModel)
T = TypeVar("T")


@dataclass
class ServerState:
    args: ServerArgs
    manager: TokenizerManager
    metrics: ServerMetrics
    token_bytes: TokenBytes
    model_name: str
    created: int

    @property
    def tokenizer(self) -> Any:
        return self.manager.tokenizer

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise model_not_found(model)

    def check_healthy(self) -> None:
        if not self.manager.healthy:
            raise unavailable("the scheduler is not running")


def server_state(request: Request) -> ServerState:
    return request.app.state.batonlm


async def read_json(request: Request, limit: int) -> Any:
    """The request body as JSON: 413 above `limit` bytes, 400 if not valid JSON."""
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise APIError(413, f"request body exceeds {limit} bytes", code="request_too_large")
    try:
        return json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise bad_request(f"the request body is not valid JSON: {e}", code="invalid_json") from None


def parse(model: type[M], data: Any) -> M:
    if not isinstance(data, dict):
        raise bad_request("the request body must be a JSON object", code="invalid_json")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise from_validation_error(e) from None


async def until_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Run `work`; if the client goes away first, cancel it (its requests are aborted)."""
    task = asyncio.ensure_future(work)

    async def watch() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(watch())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
        watcher.cancel()
    if task.cancelled():
        raise APIError(499, "client disconnected", code="client_disconnected")
    return task.result()
