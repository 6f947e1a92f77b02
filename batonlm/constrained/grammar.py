"""What a constraint is, and its frontend check (syntax only: no tokenizer, no compile).

A request carries at most one constraint as text: a JSON schema (JSON text), a regular
expression, or an EBNF grammar (SamplingParams.json_schema / .regex / .ebnf). The frontend
parses it before anything starts, so a bad one is a 400 naming its field; the scheduler process
compiles it against the vocabulary (grammar_cache.py).
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable

from batonlm.constrained.schema_support import UnenforcedKeyword, check_enforced

KINDS = ("json_schema", "regex", "ebnf")
# The OpenAI `response_format: {"type": "json_object"}`: any JSON object.
JSON_OBJECT_SCHEMA = '{"type": "object"}'
# bounded: at most this many whitespace characters in a row between JSON tokens.
BOUNDED_WHITESPACE = 2


class InvalidConstraint(ValueError):
    """The constraint does not parse; the message says why in one line."""


@functools.lru_cache(maxsize=256)
def check_constraint(kind: str, text: str) -> None:
    """Raise InvalidConstraint when `text` is not a valid `kind` (cached: requests repeat them)."""
    import xgrammar as xgr

    if kind == "json_schema":
        try:
            schema = json.loads(text)
        except json.JSONDecodeError as e:
            raise InvalidConstraint(f"not valid JSON: {e}") from None
        if not isinstance(schema, (dict, bool)):
            raise InvalidConstraint(f"a JSON schema is an object, got {type(schema).__name__}")
        try:
            check_enforced(schema)
        except UnenforcedKeyword as e:
            raise InvalidConstraint(str(e)) from None
    builders: dict[str, Callable[[str], object]] = {"json_schema": xgr.Grammar.from_json_schema, "regex": xgr.Grammar.from_regex,
                "ebnf": xgr.Grammar.from_ebnf}
    if kind not in builders:
        raise InvalidConstraint(f"unknown constraint kind {kind!r} (known: {', '.join(KINDS)})")
    try:
        builders[kind](text)
    except Exception as e:  # xgrammar's parse errors: RuntimeError, InvalidJSONError, ...
        raise InvalidConstraint(backend_message(e)) from None


def backend_message(e: BaseException) -> str:
    """The grammar backend's error as a client may read it: its last line, without the "[time]
    /path/source.cc:line: " prefixes xgrammar writes (internals that an answer never carries)."""
    lines = [line for line in str(e).strip().splitlines() if line.strip()]
    message = lines[-1] if lines else type(e).__name__
    return re.sub(r"(\[[0-9:.]+\] )?\S+\.(cc|cpp|h|hpp|py):[0-9]+: ", "", message).strip() or type(e).__name__
