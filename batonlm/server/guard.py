"""The outermost checks of every HTTP request, as a plain ASGI middleware: a request id, the API
key, the declared body size, and the last line of defence against an unexpected exception.

Not a `@app.middleware("http")` function: Starlette's BaseHTTPMiddleware pipes every streamed
chunk through extra tasks and memory streams, which cost a third of the frontend's CPU when
64 streams were open (measured with py-spy).
"""

from __future__ import annotations

import hmac
import logging
import re
import uuid

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from batonlm.server.errors import APIError, current_request_id, dialect_of, to_api_error, too_large

logger = logging.getLogger(__name__)

# With an API key, every route needs it but these (probes and the API's description): a route
# added later is guarded without anyone remembering to.
_OPEN_PATHS = frozenset({"/health", "/version", "/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json"})
# A client's own X-Request-Id is kept when it is short and plain; otherwise one is made.
_CLIENT_ID = re.compile(rb"[A-Za-z0-9._:-]{1,64}")


class GuardMiddleware:
    def __init__(self, app: ASGIApp, api_key: str | None, max_request_bytes: int,
                 metrics_require_key: bool = False) -> None:
        self.app = app
        self.expected_auth = f"Bearer {api_key}".encode() if api_key else None
        self.max_request_bytes = max_request_bytes
        self.open_paths = _OPEN_PATHS if metrics_require_key else _OPEN_PATHS | {"/metrics"}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        client_id = headers.get(b"x-request-id", b"")
        rid = client_id.decode() if _CLIENT_ID.fullmatch(client_id) else f"req_{uuid.uuid4().hex}"
        current_request_id.set(rid)
        id_header = (b"x-request-id", rid.encode())
        started = False

        async def send_with_id(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                message["headers"] = [*message.get("headers", []), id_header]
            await send(message)

        dialect = dialect_of(scope["path"])
        error = self._check(scope, headers, dialect)
        if error is not None:
            await error.response(dialect)(scope, receive, send_with_id)
            return
        try:
            await self.app(scope, receive, send_with_id)
        except Exception:
            # A bug: logged once, with the request id; the client gets a bare 500.
            logger.exception("unhandled error on %s %s (request %s)", scope["method"], scope["path"], rid)
            if not started:
                await to_api_error(RuntimeError()).response(dialect)(scope, receive, send_with_id)

    def _check(self, scope: Scope, headers: dict[bytes, bytes], dialect: str) -> APIError | None:
        if self.expected_auth is not None and scope["path"] not in self.open_paths:
            given = headers.get(b"authorization", b"")
            if dialect == "anthropic" and b"x-api-key" in headers:  # Anthropic's clients send the key there
                given = b"Bearer " + headers[b"x-api-key"]
            if not hmac.compare_digest(given, self.expected_auth):
                return APIError(401, "Incorrect API key provided.", code="invalid_api_key")
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_request_bytes:
            return too_large(self.max_request_bytes)
        return None
