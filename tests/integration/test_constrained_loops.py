"""Constrained decoding in the scheduler: both loops give the same tokens on a mix of
constrained and free requests, constrained batches sample through the delayed path with grammar
masks, a shared constraint compiles once, and a compile never holds up the running requests."""

from __future__ import annotations

import json
import re
import threading

import jsonschema
import pytest
from helpers import SchedulerHarness
from transformers import AutoTokenizer

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 1, "maximum": 99},
        "pet": {"enum": ["cat", "dog", "bird"]},
    },
    "required": ["name", "age", "pet"],
}
REGEX = r"(yes|no), [a-z]{2,6}\."


@pytest.fixture(scope="module")
def harness(stories_path):
    h = SchedulerHarness(stories_path, max_running_requests=16)
    yield h
    h.close()


@pytest.fixture(scope="module")
def tokenizer(stories_path):
    return AutoTokenizer.from_pretrained(stories_path)


def _text(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True)


def _mixed(h: SchedulerHarness) -> None:
    prompts = [[1, 403, 407], [1, 300, 301, 302], [1, 261], [1, 500, 421, 380, 290]]
    for i in range(8):
        params = {"max_new_tokens": 120, "temperature": 0.0 if i % 2 else 0.8, "seed": i}
        if i % 4 == 0:
            params["json_schema"] = json.dumps(SCHEMA)
        elif i % 4 == 1:
            params["regex"] = REGEX
        else:
            params["max_new_tokens"] = 25
        h.submit(f"r{i}", prompts[i % len(prompts)], params, at=i)


def test_both_loops_give_the_same_tokens_and_the_constraints_hold(harness, tokenizer):
    out = {}
    for overlap in (False, True):
        before = harness.sched.grammars.masked_batches
        _mixed(harness)
        records = harness.run(overlap=overlap)
        harness.assert_all_free()
        assert harness.sched.grammars.masked_batches > before, "constrained batches were not masked"
        out[overlap] = {k: r.token_ids for k, r in records.items()}
    assert out[False] == out[True]
    for i in range(8):
        text = _text(tokenizer, out[True][f"r{i}"])
        if i % 4 == 0:
            jsonschema.validate(json.loads(text), SCHEMA)
        elif i % 4 == 1:
            assert re.fullmatch(REGEX, text), text


def test_delayed_sampling_is_taken_only_by_constrained_batches(harness):
    asked = []
    needs = harness.sched.needs_delayed_sampling
    harness.sched.needs_delayed_sampling = lambda batch: asked.append(needs(batch)) or asked[-1]
    try:
        harness.submit("free", [1, 403], {"max_new_tokens": 10, "temperature": 0.0})
        harness.run(overlap=True)
        assert asked and not any(asked)
        harness.submit("json", [1, 403], {"max_new_tokens": 60, "temperature": 0.0, "json_schema": json.dumps(SCHEMA)})
        harness.run(overlap=True)
        assert any(asked)
    finally:
        del harness.sched.needs_delayed_sampling


def test_twenty_requests_sharing_a_schema_compile_it_once(harness, tokenizer):
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"]}
    cache = harness.sched.grammars.cache
    before = cache.compiles
    for i in range(20):
        harness.submit(f"s{i}", [1, 300 + i], {"max_new_tokens": 30, "temperature": 0.7, "seed": i,
                                              "json_schema": json.dumps(schema)})
    records = harness.run(overlap=True)
    harness.assert_all_free()
    assert cache.compiles == before + 1
    for r in records.values():
        jsonschema.validate(json.loads(_text(tokenizer, r.token_ids)), schema)


def test_a_compile_does_not_hold_up_running_requests(harness):
    """The constrained request's compile is held until the free request has produced all its
    tokens: if the loop waited for the compile, the free request could never finish."""
    cache = harness.sched.grammars.cache
    release, order = threading.Event(), []
    compile_ = cache._compile

    def slow_compile(kind, text):
        release.wait(timeout=60)
        order.append("compiled")
        return compile_(kind, text)

    cache._compile = slow_compile
    harness.submit("free", [1, 403, 407], {"max_new_tokens": 40, "temperature": 0.0})
    harness.submit("slow", [1, 403], {"max_new_tokens": 40, "temperature": 0.0, "regex": "[a-z]{3,9}"})
    io = harness.io

    def on_output(_):
        rec = io.records.get("free")
        if rec is not None and rec.finish_reason is not None and not release.is_set():
            order.append("free finished")
            release.set()

    io.on_output = on_output
    try:
        records = harness.run(overlap=True)
    finally:
        cache._compile = compile_
        io.on_output = None
    assert order == ["free finished", "compiled"]
    assert len(records["free"].token_ids) == 40 and records["slow"].token_ids
    harness.assert_all_free()


def test_a_grammar_that_fails_to_compile_fails_only_its_request(harness):
    cache = harness.sched.grammars.cache
    compile_ = cache._compile

    def failing(kind, text):
        raise RuntimeError("out of grammar memory")

    cache._compile = failing
    try:
        harness.submit("bad", [1, 403], {"max_new_tokens": 10, "ebnf": 'root ::= "x" "y"'})
        harness.submit("ok", [1, 403], {"max_new_tokens": 10, "temperature": 0.0})
        records = harness.run(overlap=True)
    finally:
        cache._compile = compile_
    assert records["bad"].finish_reason == "abort" and "could not be compiled" in records["bad"].error
    assert len(records["ok"].token_ids) == 10
    harness.assert_all_free()
