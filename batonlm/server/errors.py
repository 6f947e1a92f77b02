"""OpenAI-style errors: `{"error": {"message", "type", "param", "code", "request_id"}}` with a
4xx/5xx status (and the request id in the `x-request-id` header of every response). The routes of
Anthropic's Messages API answer the same errors in its shape (`dialect_of`):
`{"type": "error", "error": {"type", "message"}, "request_id"}`.

`to_api_error` is the one place an exception becomes an HTTP error: the app's exception
handlers and the streaming bodies (whose errors arrive after the 200) both go through it. A
client never sees a traceback, an exception type or a path: unexpected errors are logged and
answered with a bare "internal error".
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import re
from collections.abc import Iterator
from typing import Any

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException

from batonlm.request_checks import RequestRejected
from batonlm.sampling_params import InvalidSamplingParams
from batonlm.tokenizer_manager.request_state import ClientTooSlow, QueueFull, RequestTimedOut, SchedulerGone

logger = logging.getLogger(__name__)

# The id of the HTTP request being served (set by the guard middleware; tasks a handler starts
# inherit it), carried by every error body and the x-request-id header.
current_request_id: contextvars.ContextVar[str | None] = contextvars.ContextVar("request_id", default=None)


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self, dialect: str = "openai") -> dict:
        request_id = current_request_id.get()
        if dialect == "anthropic":
            kind = _ANTHROPIC_TYPES.get(self.status, "api_error" if self.status >= 500 else "invalid_request_error")
            # Anthropic's errors have no `param`: the message names the field.
            named = self.param is None or self.param in self.message
            message = self.message if named else f"{self.param}: {self.message}"
            out: dict = {"type": "error", "error": {"type": kind, "message": message}}
            if request_id is not None:
                out["request_id"] = request_id
            return out
        error = {"message": self.message, "type": self.type, "param": self.param, "code": self.code}
        if request_id is not None:
            error["request_id"] = request_id
        return {"error": error}

    def response(self, dialect: str = "openai") -> JSONResponse:
        return JSONResponse(self.body(dialect), status_code=self.status, headers=self.headers)


# Anthropic's error types by status (its documented set; a status it does not list: by class).
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 408: "timeout_error", 413: "request_too_large",
                    429: "rate_limit_error", 500: "api_error", 503: "overloaded_error", 529: "overloaded_error"}
ANTHROPIC_PATH = "/v1/messages"


def dialect_of(path: str) -> str:
    """The error shape of a route: "anthropic" for /v1/messages and below it, else "openai"."""
    return "anthropic" if path == ANTHROPIC_PATH or path.startswith(ANTHROPIC_PATH + "/") else "openai"


class ClientGone(Exception):
    """The client disconnected before its response could be sent (logged as 499, never answered)."""


@contextlib.contextmanager
def renamed_params(renames: tuple[tuple[str, str], ...]) -> Iterator[None]:
    """Errors raised inside name fields as the request the user wrote names them: a dialect
    read as a chat request renames the chat fields (pattern, replacement: `re.sub`'s)."""
    try:
        yield
    except APIError as e:
        if e.param is not None and (renamed := rename_param(e.param, renames)) != e.param:
            e.message, e.param = e.message.replace(e.param, renamed), renamed
        raise


def rename_param(param: str, renames: tuple[tuple[str, str], ...]) -> str:
    """A chat request's field as the dialect's request names it (the first rename that applies)."""
    for pattern, name in renames:
        if (renamed := re.sub(pattern, name, param)) != param:
            return renamed
    return param


def bad_request(message: str, param: str | None = None, code: str = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


def model_not_found(model: str, param: str = "model") -> APIError:
    return APIError(404, f"The model `{model}` does not exist.", param=param, code="model_not_found")


def unavailable(message: str, code: str = "scheduler_unavailable", headers: dict[str, str] | None = None) -> APIError:
    return APIError(503, message, type="service_unavailable", code=code, headers=headers)


def too_large(limit: int) -> APIError:
    return APIError(413, f"request body exceeds {limit} bytes", code="request_too_large")


def from_validation_error(err: ValidationError) -> APIError:
    """The first pydantic error, as a 400 that names the offending field."""
    errors = err.errors()
    first = errors[0]
    if len(errors) > 1 and _union_member(first):
        # A union's members each failed (`input`: a string, or a list of items): the error that
        # went deepest is the one about what the user meant.
        first = max(errors, key=lambda e: len(e.get("loc", ())))
    loc = [str(p) for p in first.get("loc", ()) if not str(p).startswith("function-")]
    # pydantic reports union members as extra loc parts ("str", "list[...]"); keep field names.
    param = ".".join(p for p in loc if not any(c in p for c in "[]") and p not in ("str", "int", "float", "bool"))
    kind = first.get("type", "")
    if kind == "extra_forbidden":
        return APIError(400, f"Unrecognized request argument supplied: {param}", param=param, code="unknown_parameter")
    if kind == "missing":
        return APIError(400, f"Missing required parameter: '{param}'.", param=param, code="missing_required_parameter")
    msg = first.get("msg", "invalid value").removeprefix("Value error, ")
    return APIError(400, f"Invalid value for '{param}': {msg}" if param else msg, param=param or None, code="invalid_value")


def _union_member(error: Any) -> bool:
    """Whether a pydantic error is about one member of a union (its last location part names a
    type: "str", "list[...]")."""
    loc = error.get("loc", ())
    return bool(loc) and (str(loc[-1]) in ("str", "int", "float", "bool") or "[" in str(loc[-1]))


# Exceptions that are a client's mistake or a known state of the server: answered without a
# traceback in the log. Anything else is a bug, logged, and answered with a bare 500.
EXPECTED_ERRORS: tuple[type[Exception], ...] = (
    APIError,
    ValidationError,
    RequestValidationError,
    InvalidSamplingParams,
    RequestRejected,
    SchedulerGone,
    RequestTimedOut,
    ClientTooSlow,
    QueueFull,
    ClientGone,
    HTTPException,
    RecursionError,
)


def to_api_error(exc: BaseException) -> APIError:
    """The HTTP error a client gets for `exc`."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, ValidationError):
        return from_validation_error(exc)
    if isinstance(exc, RequestValidationError):
        return APIError(400, str(exc), code="invalid_value")
    if isinstance(exc, InvalidSamplingParams):
        return bad_request(f"Invalid value for '{exc.field}': {exc.message}", param=exc.field)
    if isinstance(exc, RequestRejected):
        return APIError(400, str(exc), param=exc.param, code="request_rejected")
    if isinstance(exc, SchedulerGone):
        return unavailable(str(exc))
    if isinstance(exc, QueueFull):
        return APIError(
            429, str(exc), type="rate_limit_error", code="queue_full", headers={"Retry-After": str(exc.retry_after_s)}
        )
    if isinstance(exc, RequestTimedOut):
        return APIError(408, str(exc), type="timeout_error", code="request_timeout")
    if isinstance(exc, ClientTooSlow):
        return APIError(408, str(exc), type="timeout_error", code="client_too_slow")
    if isinstance(exc, ClientGone):
        return APIError(499, "client disconnected", code="client_disconnected")
    if isinstance(exc, HTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return APIError(exc.status_code, str(exc.detail), type=kind, headers=dict(exc.headers or {}))
    if isinstance(exc, RecursionError):  # a structure nested too deeply for the validators
        return bad_request("the request body is nested too deeply", code="invalid_json")
    return APIError(500, "internal error", type="internal_error", code="internal_error")
