"""Request limits: the server arguments that bound request fields (each declares the fields it
bounds, `Bound`, in batonlm/config.py), checked before anything is tokenized or sent to the
scheduler (a 400 naming the field beyond them). The OpenAPI description states the same bounds
(`apply_limits`). Value ranges are not here: they are SamplingParams'; these are policy."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from batonlm.config import ServerArgs
from batonlm.server.errors import bad_request
from batonlm.settings import Bound, declared


@dataclass(frozen=True)
class RequestLimit:
    setting: str  # the ServerArgs field holding the limit
    bound: Bound


@functools.cache
def request_limits() -> tuple[RequestLimit, ...]:
    return tuple(RequestLimit(d.name, d.setting.bounds) for d in declared(ServerArgs) if d.setting.bounds is not None)


def _measure(measure: str, value: Any) -> int | None:
    """What a limit counts of a field's value (None: nothing it counts, e.g. chat's logprobs flag)."""
    if measure == "value":
        return value if isinstance(value, int) and not isinstance(value, bool) else None
    if not isinstance(value, str | list | dict):  # a raw body's wrong type: the parser names it
        return None
    if measure == "count":
        return 1 if isinstance(value, str) else len(value)
    if measure == "prompts":
        return 1 if isinstance(value, str) or all(isinstance(p, int) for p in value) else len(value)
    strings = [value] if isinstance(value, str) else [s for s in value if isinstance(s, str)]  # each
    return max(map(len, strings), default=0)


def check_limits(args: ServerArgs, fields: Mapping[str, Any], prefix: str = "") -> None:
    """Every limit on the request `fields` (name -> value) has; parameters are named
    `prefix + field` (e.g. "sampling_params.stop"). Run on every route's raw JSON body before it
    is parsed (`ServerState.read`: a request far beyond a limit, 88,000 tools, costs no
    validation), and by /generate on its nested sampling_params."""
    for lim in request_limits():
        for name in lim.bound.fields:
            value = fields.get(name)
            if value is None:
                continue
            count, limit = _measure(lim.bound.measure, value), getattr(args, lim.setting)
            if count is not None and count > limit:
                raise bad_request(f"at most {limit} {lim.bound.what} are allowed, got {count}", param=prefix + name,
                                  code="limit_exceeded")


def apply_limits(props: dict[str, Any], args: ServerArgs) -> None:
    """The limits as JSON-schema bounds of the properties (a request model's) they bound."""
    for lim in request_limits():
        limit = getattr(args, lim.setting)
        for name in lim.bound.fields:
            if name in props:
                _bound_schema(props[name], lim.bound.measure, limit)


def _bound_schema(schema: dict, measure: str, limit: int) -> None:
    for v in [schema, *schema.get("anyOf", [])]:
        kind = v.get("type")
        if measure == "count" and kind == "array":
            v["maxItems"] = limit
        elif measure == "count" and kind == "object":
            v["maxProperties"] = limit
        elif measure == "prompts" and kind == "array" and v["items"].get("type") != "integer":
            v["maxItems"] = limit
        elif measure == "each" and kind == "string":
            v["maxLength"] = limit
        elif measure == "each" and kind == "array" and v["items"].get("type") == "string":
            v["items"]["maxLength"] = limit
        elif measure == "value" and kind == "integer":
            v["maximum"] = limit
