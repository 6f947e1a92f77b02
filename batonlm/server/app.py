"""The FastAPI application: routes, auth, body limits, OpenAI-style errors, lifecycle."""

from __future__ import annotations

import logging
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from batonlm.config import ServerArgs
from batonlm.server import (
    anthropic_messages,
    lora_adapters,
    native,
    openai_chat,
    openai_completions,
    openai_embeddings,
    openai_responses,
    tokenize_routes,
)
from batonlm.server.errors import EXPECTED_ERRORS, dialect_of, to_api_error
from batonlm.server.guard import GuardMiddleware
from batonlm.server.metrics import ServerMetrics
from batonlm.server.openapi import build_openapi
from batonlm.server.state import ServerState
from batonlm.tokenizer_manager.manager import TokenizerManager
from batonlm.tokenizer_manager.token_bytes import TokenBytes
from batonlm.version import __version__

logger = logging.getLogger(__name__)


def create_app(args: ServerArgs, manager: TokenizerManager) -> FastAPI:
    """Build the app around a started TokenizerManager; the app's shutdown stops the scheduler."""
    metrics = ServerMetrics(args.model_name)
    manager.observer = metrics

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        try:
            yield
        finally:
            await manager.shutdown()

    app = FastAPI(title="batonlm", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.batonlm = ServerState(
        args, manager, metrics, TokenBytes(manager.tokenizer), args.model_name, int(time.time())
    )
    app.include_router(openai_chat.router)
    app.include_router(openai_completions.router)
    app.include_router(anthropic_messages.router)
    app.include_router(openai_responses.router)
    app.include_router(openai_embeddings.router)
    app.include_router(lora_adapters.router)
    app.include_router(native.router)
    app.include_router(tokenize_routes.router)

    def openapi() -> dict:
        if app.openapi_schema is None:
            app.openapi_schema = build_openapi(app, args, manager.info.context_length if manager.info else 2)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]  # FastAPI's documented way to replace the schema

    app.add_middleware(GuardMiddleware, api_key=args.api_key, max_request_bytes=args.max_request_bytes,
                       metrics_require_key=args.metrics_require_key)

    async def expected_error(request: Request, exc: Exception) -> JSONResponse:
        return to_api_error(exc).response(dialect_of(request.url.path))

    # Anything else is a bug: GuardMiddleware logs it once and answers a bare 500.
    for kind in EXPECTED_ERRORS:
        app.add_exception_handler(kind, expected_error)
    return app
