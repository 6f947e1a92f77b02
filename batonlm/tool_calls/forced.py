"""`tool_choice` "required" or a named function: the output is constrained to JSON calls (a
grammar from the functions' parameter schemas), whatever the model's own format, and parsed
as such. A model that knows no tools still returns calls whose arguments validate."""

from __future__ import annotations

import json
from typing import Any

from batonlm.tool_calls.parser import ToolCall, call_from_object

NO_ARGUMENTS = {"type": "object", "properties": {}}


def forced_schema(functions: list[tuple[str, dict[str, Any] | None]], parallel: bool) -> dict[str, Any]:
    """The JSON schema of one call of any of `functions` ((name, parameters schema) pairs), or
    with `parallel`, of a non-empty array of calls."""
    calls = [
        {"type": "object", "properties": {"name": {"const": name}, "arguments": params or NO_ARGUMENTS},
         "required": ["name", "arguments"]}
        for name, params in functions
    ]
    one = calls[0] if len(calls) == 1 else {"anyOf": calls}
    return {"type": "array", "items": one, "minItems": 1} if parallel else one


def parse_forced(text: str) -> list[ToolCall]:
    """The calls of a forced output ([] if it does not parse: cut short by max_tokens)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return []
    items = value if isinstance(value, list) else [value]
    calls = [call_from_object(v, ("arguments",)) for v in items]
    valid = [c for c in calls if c is not None]
    return valid if len(valid) == len(calls) else []
