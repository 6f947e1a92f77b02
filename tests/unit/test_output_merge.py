"""A stream whose consumer fell behind takes every waiting output as one (request_state.py):
tokens and logprobs in order, the first output's prompt facts, the last one's end, and an error
queued behind them still raised, after them."""

from __future__ import annotations

import asyncio

import pytest

from batonlm.ipc.messages import TokenOutput
from batonlm.tokenizer_manager.detokenizer import IncrementalDetokenizer
from batonlm.tokenizer_manager.request_state import RequestState
from batonlm.tokenizer_manager.stop_strings import StopStringMatcher


def state(tokenizer=None) -> RequestState:
    return RequestState("r", IncrementalDetokenizer(tokenizer, [1], True) if tokenizer else None,  # type: ignore[arg-type]
                        StopStringMatcher([]), 1)


def test_waiting_outputs_come_as_one_and_an_error_after_them_stays():
    s = state()
    s.put(TokenOutput("r", [5], logprobs=[-0.5], top_logprobs=[[(5, -0.5)]], cached_tokens=3, queued_s=0.25))
    s.put(TokenOutput("r", [6, 7], logprobs=[-1.0, -2.0], top_logprobs=[[(6, -1.0)], [(7, -2.0)]]))
    s.put(TokenOutput("r", [8], logprobs=[-3.0], top_logprobs=[[(8, -3.0)]], finish_reason="length", spec=(2, 1)))
    s.put(RuntimeError("gone"))

    async def drain():
        merged = await s.next()
        with pytest.raises(RuntimeError, match="gone"):
            await s.next()
        return merged

    out = asyncio.run(drain())
    assert out.token_ids == [5, 6, 7, 8]
    assert out.logprobs == [-0.5, -1.0, -2.0, -3.0]
    assert out.top_logprobs == [[(5, -0.5)], [(6, -1.0)], [(7, -2.0)], [(8, -3.0)]]
    assert (out.cached_tokens, out.queued_s) == (3, 0.25)
    assert (out.finish_reason, out.spec) == ("length", (2, 1))


def test_one_waiting_output_is_passed_as_it_is():
    s = state()
    one = TokenOutput("r", [5], cached_tokens=0)
    s.put(one)
    assert asyncio.run(s.next()) is one


def test_merged_text_equals_the_text_of_the_outputs_one_by_one(stories_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(stories_path)
    ids = tok("Once upon a time, a little girl named Lily found a shiny stone.").input_ids[1:]
    one_by_one, merged = state(tok), state(tok)
    text_a = ""
    for i, t in enumerate(ids):
        last = i == len(ids) - 1
        one_by_one.put(TokenOutput("r", [t], finish_reason="length" if last else None))
        merged.put(TokenOutput("r", [t], finish_reason="length" if last else None))
        text_a += one_by_one.apply(asyncio.run(one_by_one.next()), None)[0].text
    chunk, _ = merged.apply(asyncio.run(merged.next()), None)
    assert chunk.text == text_a == tok.decode(ids) and chunk.finish_reason == "length"
