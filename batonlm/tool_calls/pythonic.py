"""Pythonic tool calls (Llama 3.2 / Llama 4, Gemma, ToolACE): the whole output is a Python
list of calls with keyword arguments, `[get_weather(city="Paris", days=3), add(a=1, b=2)]`,
in Llama 4 between `<|python_start|>` and `<|python_end|>`. Values are Python literals (JSON's
true / false / null accepted too)."""

from __future__ import annotations

import ast
import json

from batonlm.tool_calls.parser import ParsedOutput, ToolCall, ToolCallParser, ToolSchemas

_JSON_NAMES = {"true": True, "false": False, "null": None}


class PythonicParser(ToolCallParser):
    name = "pythonic"
    start_markers = ("[", "<|python_start|>")
    anchored = True

    def parse(self, text: str, tools: ToolSchemas | None = None) -> ParsedOutput:
        body = text.strip().removeprefix("<|python_start|>").removesuffix("<|python_end|>").strip()
        if not body.startswith("["):
            return ParsedOutput(text, [])
        try:
            tree = ast.parse(body, mode="eval").body
            calls = [_call(node) for node in tree.elts] if isinstance(tree, ast.List) else []
        except (SyntaxError, ValueError, MemoryError, RecursionError):
            calls = []
        return ParsedOutput("", calls) if calls else ParsedOutput(text, [])


def _call(node: ast.expr) -> ToolCall:
    if not isinstance(node, ast.Call) or node.args:
        raise ValueError("not a call with keyword arguments")
    args = {}
    for kw in node.keywords:
        if kw.arg is None:
            raise ValueError("**kwargs")
        args[kw.arg] = _literal(kw.value)
    return ToolCall(_name(node.func), json.dumps(args, ensure_ascii=False))


def _name(func: ast.expr) -> str:
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute):
        return f"{_name(func.value)}.{func.attr}"
    raise ValueError("not a function name")


def _literal(node: ast.expr):
    if isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    if isinstance(node, ast.List):
        return [_literal(v) for v in node.elts]
    if isinstance(node, ast.Dict):
        return {_literal(k): _literal(v) for k, v in zip(node.keys, node.values, strict=True) if k is not None}
    return ast.literal_eval(node)
