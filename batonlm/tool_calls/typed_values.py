"""Arguments written as text (Qwen3-Coder's XML parameters) read as the JSON values their
parameter schema says they are: a string stays text, numbers, booleans, objects and arrays are
parsed; without a schema, text that is JSON other than a string is taken as that value."""

from __future__ import annotations

import ast
import json
from typing import Any


def typed_value(text: str, schema: dict[str, Any] | None) -> Any:
    kinds = _types(schema)
    if kinds == {"string"}:
        return text
    if text.strip() == "null" and (not kinds or "null" in kinds):
        return None
    for kind in ("integer", "number", "boolean", "object", "array"):
        if kind in kinds or not kinds:
            value = _as(kind, text.strip())
            if value is not _NOT:
                return value
    return text


_NOT = object()


def _as(kind: str, text: str) -> Any:
    if kind == "boolean":
        return {"true": True, "false": False}.get(text.lower(), _NOT)
    if kind in ("integer", "number"):
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            return _NOT
        ok = isinstance(value, int) if kind == "integer" else isinstance(value, int | float)
        return value if ok and not isinstance(value, bool) else _NOT
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        try:  # a Python literal ({'a': 1}, [True]), as these models sometimes write
            value = ast.literal_eval(text)
        except (ValueError, SyntaxError, MemoryError, RecursionError):
            return _NOT
    return value if isinstance(value, dict if kind == "object" else list) else _NOT


def _types(schema: dict[str, Any] | None) -> set[str]:
    if not isinstance(schema, dict):
        return set()
    kind = schema.get("type")
    if isinstance(kind, str):
        return {kind}
    if isinstance(kind, list):
        return {k for k in kind if isinstance(k, str)}
    kinds: set[str] = set()
    for alt in schema.get("anyOf", []) + schema.get("oneOf", []):
        kinds |= _types(alt)
    if "enum" in schema and not kinds:
        kinds = {"string"} if all(isinstance(v, str) for v in schema["enum"]) else set()
    return kinds
