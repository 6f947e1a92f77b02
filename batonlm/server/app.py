"""The FastAPI application: routes, auth, body limits, OpenAI-style errors, lifecycle."""

from __future__ import annotations

import logging
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from batonlm.config import ServerArgs
from batonlm.request_checks import RequestRejected
from batonlm.server import native, openai_chat, openai_completions
from batonlm.server.errors import APIError, unavailable
from batonlm.server.guard import GuardMiddleware
from batonlm.server.metrics import ServerMetrics
from batonlm.server.state import ServerState
from batonlm.tokenizer_manager.manager import SchedulerGone, TokenizerManager
from batonlm.tokenizer_manager.token_bytes import TokenBytes

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

    app = FastAPI(title="batonlm", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.batonlm = ServerState(
        args, manager, metrics, TokenBytes(manager.tokenizer), args.model_name, int(time.time())
    )
    app.include_router(openai_chat.router)
    app.include_router(openai_completions.router)
    app.include_router(native.router)

    app.add_middleware(GuardMiddleware, api_key=args.api_key, max_request_bytes=args.max_request_bytes)

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(SchedulerGone)
    async def scheduler_gone(request: Request, exc: SchedulerGone) -> JSONResponse:
        return unavailable(str(exc)).response()

    @app.exception_handler(RequestRejected)
    async def rejected(request: Request, exc: RequestRejected) -> JSONResponse:
        return APIError(400, str(exc), code="request_rejected").response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return APIError(400, str(exc), code="invalid_value").response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return APIError(exc.status_code, str(exc.detail), type=kind).response()

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s", request.url.path)
        return APIError(500, f"internal error: {type(exc).__name__}", type="internal_error").response()

    return app
