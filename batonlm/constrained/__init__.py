"""Constrained decoding: JSON schemas, regular expressions and EBNF grammars turned into
per-step token masks (xgrammar behind a small interface)."""
