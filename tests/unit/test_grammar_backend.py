"""The xgrammar backend on the embedded model's vocabulary: stop tokens allowed where the
grammar may end, other special tokens never; the whitespace modes of JSON schemas; and the
frontend check's one-line errors."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from batonlm.constrained.grammar import InvalidConstraint, check_constraint
from batonlm.constrained.xgrammar_backend import XGrammarBackend

SCHEMA = json.dumps({"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
                     "required": ["a"]})


@pytest.fixture(scope="module")
def tokenizer(stories_path):
    return AutoTokenizer.from_pretrained(stories_path)


def _allowed(backend, matcher) -> set[int]:
    bitmask = backend.allocate_bitmask(1)
    matcher.fill_mask(bitmask, 0)
    return {t for t in range(backend.vocab_size) if (int(bitmask[0, t // 32]) >> (t % 32)) & 1}


def _walk(backend, tokenizer, kind: str, text: str, prefix: str):
    """A matcher that has accepted `prefix`, one byte-fallback token per byte (<0xHH> = 3 + byte)."""
    matcher = backend.matcher(backend.compile(kind, text))
    for byte in prefix.encode():
        assert matcher.accept(3 + byte)
    return matcher


def test_special_tokens(stories_path, tokenizer):
    backend = XGrammarBackend(stories_path, 512, [2], "bounded")
    matcher = _walk(backend, tokenizer, "regex", "(yes|no)", "yes")
    allowed = _allowed(backend, matcher)
    assert 2 in allowed  # the stop token, once the grammar may end
    assert 0 not in allowed and 1 not in allowed  # <unk>, and <s> (not a stop token here)
    assert matcher.accept(2) and matcher.terminated


@pytest.mark.parametrize(("mode", "spaces_ok", "third_space_ok"), [("compact", False, False), ("bounded", True, False),
                                                                  ("any", True, True)])
def test_whitespace_modes(stories_path, tokenizer, mode, spaces_ok, third_space_ok):
    backend = XGrammarBackend(stories_path, 512, [2], mode)
    space = tokenizer.convert_tokens_to_ids("<0x20>")
    newline = tokenizer.convert_tokens_to_ids("<0x0A>")
    matcher = _walk(backend, tokenizer, "json_schema", SCHEMA, "{")
    assert (space in _allowed(backend, matcher)) == spaces_ok
    if spaces_ok:
        assert matcher.accept(space) and matcher.accept(newline)
        assert (space in _allowed(backend, matcher)) == third_space_ok


@pytest.mark.parametrize(("kind", "text", "words"), [
    ("json_schema", '{"type": "objec"}', "Unsupported type"),
    ("json_schema", '{"type": ', "not valid JSON"),
    ("json_schema", "[1]", "a JSON schema is an object"),
    ("regex", "(ab", "parenthesis"),
    ("ebnf", 'root ::= "a" |', "EBNF"),
    ("sql", "x", "unknown constraint kind"),
])
def test_frontend_check_errors_are_one_line(kind, text, words):
    with pytest.raises(InvalidConstraint) as err:
        check_constraint(kind, text)
    assert words in str(err.value) and "\n" not in str(err.value) and ".cc:" not in str(err.value)
