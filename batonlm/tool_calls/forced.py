"""`tool_choice` "required" or a named function: the output is constrained to JSON calls (a
grammar from the functions' parameter schemas), whatever the model's own format, and parsed
as such. A model that knows no tools still returns calls whose arguments validate.

With parallel calls the output is an array the model closes when it has made its calls. When
it would rather go on, `CallsBudget` ends it after the last complete call once the next could
not complete within the tokens left (it takes as many as the longest call so far); a call cut
by max_tokens is dropped and the complete ones before it are returned (`parse_forced`)."""

from __future__ import annotations

import json
import re
from typing import Any

from batonlm.tokenizer_manager.stop_strings import StopStringMatcher
from batonlm.tool_calls.parser import ToolCall, call_from_object
from batonlm.tool_calls.streaming import PartialCall, call_objects

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


def complete_items(text: str) -> list[Any]:
    """The complete items at the start of a JSON array, closed or cut short."""
    decoder = json.JSONDecoder()
    at = _skip_space(text, 0)
    if not text.startswith("[", at):
        return []
    items: list[Any] = []
    at = _skip_space(text, at + 1)
    while at < len(text) and text[at] != "]":
        try:
            item, at = decoder.raw_decode(text, at)
        except json.JSONDecodeError:
            break
        items.append(item)
        at = _skip_space(text, at)
        if not text.startswith(",", at):
            break
        at = _skip_space(text, at + 1)
    return items


def _skip_space(text: str, at: int) -> int:
    while at < len(text) and text[at] in " \t\n\r":
        at += 1
    return at


def parse_forced(text: str) -> list[ToolCall]:
    """The calls of a forced output: all of them, or of an array cut short by max_tokens the
    complete ones ([]: none complete)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        value = complete_items(text)
    items = value if isinstance(value, list) else [value]
    calls = [call_from_object(v, ("arguments",)) for v in items]
    valid = [c for c in calls if c is not None]
    return valid if len(valid) == len(calls) else []


def partial_forced(text: str) -> list[PartialCall]:
    """The calls of a forced output so far: an array of call objects, or one."""
    at = _skip_space(text, 0)
    if text.startswith("[", at):
        return call_objects(text, at + 1, ",")
    return call_objects(text, at)[:1]


class CallsBudget(StopStringMatcher):
    """Stop strings, and the end of a forced array of calls: after each complete call, when the
    tokens left (of `max_new_tokens`) are fewer than the longest call so far took (and one for
    the closing bracket), the text ends there; the request stops as for a stop string."""

    def __init__(self, stops: list[str], max_new_tokens: int) -> None:
        super().__init__(stops)
        self.max_new_tokens = max_new_tokens
        self.text = ""
        self._depth = 0
        self._in_string = self._escaped = False
        self._tokens_at_end = 0  # when the last call completed
        self.longest = 0  # tokens the longest complete call took

    def feed(self, delta: str, armed: bool = True, tokens: int = 0) -> str:
        out = super().feed(delta, armed, tokens)
        if self.stopped:
            return out
        start = len(self.text)
        self.text += out
        for i in range(start, len(self.text)):
            if self._call_ends(self.text[i]):
                self.longest = max(self.longest, tokens - self._tokens_at_end)
                self._tokens_at_end = tokens
                if self.max_new_tokens - tokens < self.longest + 1:
                    self.stopped = True
                    self._held = ""
                    return out[: i + 1 - start]
        return out

    def _call_ends(self, ch: str) -> bool:
        """Track the array's structure one character at a time: does `ch` close a call?"""
        if self._in_string:
            if self._escaped:
                self._escaped = False
            elif ch == "\\":
                self._escaped = True
            elif ch == '"':
                self._in_string = False
            return False
        if ch == '"':
            self._in_string = True
        elif ch in "[{":
            self._depth += 1
        elif ch in "]}":
            self._depth -= 1
            return ch == "}" and self._depth == 1
        return False
