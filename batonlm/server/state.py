"""What the request handlers share: one object per server instance, kept on `app.state`."""

from __future__ import annotations

import asyncio
import functools
import json
import os
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import orjson
from fastapi import Request
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect

from batonlm.config import ServerArgs
from batonlm.server import limits
from batonlm.server.errors import (
    APIError,
    ClientGone,
    bad_request,
    from_validation_error,
    model_not_found,
    too_large,
    unavailable,
)
from batonlm.server.metrics import ServerMetrics

if TYPE_CHECKING:
    from batonlm.server.lora_adapters import AdapterRegistry
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

    @functools.cached_property
    def tool_parser(self):
        """The tool-call format of this model (`--tool-call-parser`; auto: from its chat template
        and architecture)."""
        from batonlm.tool_calls.formats import parser_for

        info = self.manager.info
        architecture = None
        try:
            with open(os.path.join(info.model_path if info else self.args.model, "config.json")) as f:
                architecture = (json.load(f).get("architectures") or [None])[0]
        except (OSError, ValueError):
            pass
        template = getattr(self.tokenizer, "chat_template", None)
        return parser_for(self.args.tool_call_parser, architecture, template if isinstance(template, str) else None)

    def check_model(self, model: str | None) -> None:
        """404 unless `model` names the served model (its id, or the MODEL argument as given) or
        one of its LoRA adapters."""
        self.lora_adapter(model)

    @functools.cached_property
    def adapters(self) -> AdapterRegistry:
        """The LoRA adapters served (--lora-paths, and those loaded at run time)."""
        from batonlm.server.lora_adapters import AdapterRegistry

        return AdapterRegistry(self.args)

    def lora_adapter(self, model: str | None, param: str = "model") -> int:
        """The load key of the LoRA adapter a request's `model` selects (0: the base model); a 404
        for another name."""
        if model is None or model in (self.model_name, self.args.model):
            return 0
        adapter = self.adapters.by_name.get(model)
        if adapter is None:
            raise model_not_found(model, param)
        return adapter.key

    async def read(self, request: Request, model: type[M]) -> M:
        """The request body, read within the limits and parsed into `model`."""
        data = await read_json(request, self.args.max_request_bytes, self.args.client_timeout)
        if isinstance(data, dict):
            limits.check_limits(self.args, data)
        return parse(model, data)

    def check_generates(self) -> None:
        """400 on a generation route when the model is an embedding model (no LM head)."""
        info = self.manager.info
        if info is not None and info.embedding_only:
            raise bad_request(f"model {self.model_name!r} is an embedding model (its checkpoint has no LM head): it "
                              "serves /v1/embeddings only", param="model", code="embedding_model")

    def check_healthy(self) -> None:
        if not self.manager.healthy:
            raise unavailable("the scheduler is not running")
        if self.manager.draining:
            raise unavailable("the server is shutting down", code="shutting_down")


def server_state(request: Request) -> ServerState:
    return request.app.state.batonlm


async def read_json(request: Request, limit: int, timeout_s: float) -> Any:
    """The request body as JSON: 413 above `limit` bytes, 408 when it takes longer than
    `timeout_s` to arrive, 400 when it is not JSON (invalid UTF-8, a lone surrogate, nesting
    deeper than 1024, an integer beyond 64 bits as a float)."""

    async def receive() -> bytes:
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise too_large(limit)
        return bytes(body)

    try:
        body = await asyncio.wait_for(receive(), timeout_s)
    except asyncio.TimeoutError:
        raise APIError(408, f"the request body did not arrive within {timeout_s:g} s", code="request_timeout") from None
    except ClientDisconnect:
        raise ClientGone() from None
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as e:
        raise bad_request(f"the request body is not valid JSON: {e}", code="invalid_json") from None


def parse(model: type[M], data: Any) -> M:
    if not isinstance(data, dict):
        raise bad_request("the request body must be a JSON object", code="invalid_json")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise from_validation_error(e) from None


async def until_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Run `work`; if the client goes away first, cancel it (its requests are aborted) and raise
    ClientGone."""
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
        watcher.cancel()
        if not task.done():
            task.cancel()
            # Let the cancellation run to its end (the requests' aborts are sent on the way).
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        raise ClientGone()
    return task.result()
