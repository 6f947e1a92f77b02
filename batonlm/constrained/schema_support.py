"""The JSON-schema keywords the grammar backend does not enforce, refused rather than ignored.

xgrammar compiles most of JSON Schema into its grammar, but some keywords it accepts and then
ignores: the output would not validate against the schema the client sent, with a 200. Probed
with a byte-level vocabulary (a matcher fed an instance that breaks only that keyword):

* `not`, `if` / `then` / `else`: ignored;
* `allOf` with more than one subschema: the intersection is not taken (`[string, integer]`
  accepts a string); one subschema (pydantic's `allOf: [{"$ref": ...}]`) is that schema;
* a `$ref` outside the document (`file:`, `http:`): a warning, then ignored;
* a `pattern` with lookaround, which the backend's regular expressions lack.

`oneOf` is enforced as `anyOf` (not exclusively); it stays accepted: pydantic writes its
unions so, and exclusivity rarely matters to generation.
"""

from __future__ import annotations

from typing import Any

IGNORED = ("not", "if", "then", "else")
_SUBSCHEMA = ("additionalProperties", "items", "contains", "propertyNames", "additionalItems",
              "unevaluatedItems", "unevaluatedProperties")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_LOOKAROUND = ("(?=", "(?!", "(?<=", "(?<!")


class UnenforcedKeyword(ValueError):
    """A schema keyword the grammar backend would ignore; `path` is where it is."""

    def __init__(self, path: str, message: str) -> None:
        super().__init__(f"{path}: {message}" if path else message)
        self.path = path


def check_enforced(schema: Any, path: str = "") -> None:
    """Raise UnenforcedKeyword at the first keyword of `schema` the backend would not enforce."""
    if not isinstance(schema, dict):
        return
    for key in IGNORED:
        if key in schema:
            raise UnenforcedKeyword(_join(path, key), f"the keyword {key!r} is not supported in constraints")
    all_of = schema.get("allOf")
    if isinstance(all_of, list) and len(all_of) > 1:
        raise UnenforcedKeyword(_join(path, "allOf"), "allOf with more than one schema is not supported in "
                                "constraints (merge them into one)")
    ref = schema.get("$ref")
    if isinstance(ref, str) and not ref.startswith("#"):
        raise UnenforcedKeyword(_join(path, "$ref"), f"only references inside the schema (#/...) are supported, "
                                f"got {ref[:80]!r}")
    pattern = schema.get("pattern")
    if isinstance(pattern, str) and any(a in pattern for a in _LOOKAROUND):
        raise UnenforcedKeyword(_join(path, "pattern"), "lookahead and lookbehind are not supported in patterns")
    for key in _SUBSCHEMA:
        check_enforced(schema.get(key), _join(path, key))
    for key in _SUBSCHEMA_MAPS:
        sub = schema.get(key)
        if isinstance(sub, dict):
            for name, value in sub.items():
                check_enforced(value, _join(path, key, name))
    for key in _SUBSCHEMA_LISTS:
        sub = schema.get(key)
        if isinstance(sub, list):
            for i, value in enumerate(sub):
                check_enforced(value, _join(path, key, str(i)))


def _join(*parts: str) -> str:
    return ".".join(p for p in parts if p)
