"""`tool_choice` "required" or a named function: the output is constrained to JSON calls (a
grammar from the functions' parameter schemas), whatever the model's own format, and parsed
as such. A model that knows no tools still returns calls whose arguments validate."""

from __future__ import annotations

import json
import re
from typing import Any

from batonlm.tool_calls.parser import ToolCall, call_from_object

NO_ARGUMENTS = {"type": "object", "properties": {}}


def forced_schema(functions: list[tuple[str, dict[str, Any] | None]], parallel: bool) -> dict[str, Any]:
    """The JSON schema of one call of any of `functions` ((name, parameters schema) pairs), or
    with `parallel`, of a non-empty array of calls. Each function's local definitions (`$defs`,
    `definitions`: what pydantic writes for nested models) move to the root, renamed per
    function, with its `$ref`s: nested in the combined schema, "#/$defs/X" would point nowhere."""
    defs: dict[str, Any] = {}
    calls = [
        {"type": "object",
         "properties": {"name": {"const": name}, "arguments": _hoist_defs(params or NO_ARGUMENTS, f"f{i}_", defs)},
         "required": ["name", "arguments"]}
        for i, (name, params) in enumerate(functions)
    ]
    one = calls[0] if len(calls) == 1 else {"anyOf": calls}
    schema = {"type": "array", "items": one, "minItems": 1} if parallel else one
    return {**schema, "$defs": defs} if defs else schema


_LOCAL_REF = re.compile(r"^#/(\$defs|definitions)/")


def _hoist_defs(params: dict[str, Any], prefix: str, defs: dict[str, Any]) -> dict[str, Any]:
    local = {**params.get("definitions", {}), **params.get("$defs", {})}
    if not local:
        return params

    def renamed(node: Any) -> Any:
        if isinstance(node, dict):
            return {k: (_LOCAL_REF.sub(f"#/$defs/{prefix}", v) if k == "$ref" and isinstance(v, str) else renamed(v))
                    for k, v in node.items()}
        if isinstance(node, list):
            return [renamed(v) for v in node]
        return node

    for name, sub in local.items():
        defs[prefix + name] = renamed(sub)
    return renamed({k: v for k, v in params.items() if k not in ("$defs", "definitions")})


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
