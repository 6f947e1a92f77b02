"""What the tool-call parser tests share: calls as (name, arguments value), a text streamed
through a parser in random pieces, and the check that streamed call deltas build the calls."""

from __future__ import annotations

import json
import random

from batonlm.tool_calls.streaming import CallDelta, StreamingToolCalls


def call_values(calls) -> list[tuple[str, object]]:
    return [(c.name, json.loads(c.arguments)) for c in calls]


def stream_in_pieces(parser, text: str, rng: random.Random, tools=None):
    """Feed `text` to a StreamingToolCalls in 1-16 random pieces: (content sent while streaming,
    call deltas while streaming and at the end, what finish returned)."""
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 16))))
    stream = StreamingToolCalls(parser, tools)
    sent, deltas = "", []
    for a, b in zip([0, *cuts], [*cuts, len(text)]):
        sent += stream.feed(text[a:b])
        deltas += stream.deltas()
    rest, last = stream.finish()
    return sent, deltas + last, rest


def assert_deltas_build(deltas: list[CallDelta], calls) -> None:
    """The call deltas of a stream, put together by index, are the calls: ids, names, and
    arguments text for text."""
    built: dict[int, list[str]] = {}
    for d in deltas:
        if d.name is not None:
            assert d.index == len(built) and d.arguments == ""  # a call opens with its name alone
            built[d.index] = [d.id, d.name, ""]
        built[d.index][2] += d.arguments
    assert [tuple(b) for b in built.values()] == [(c.id, c.name, c.arguments) for c in calls]
