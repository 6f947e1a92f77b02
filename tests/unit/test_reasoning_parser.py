"""<think> blocks split from the answer, whole and streamed in pieces split anywhere."""

from __future__ import annotations

import random

import pytest

from batonlm.server.reasoning import ReasoningStream, split_reasoning

CASES = [
    ("qwen3", "<think>\nThe user asks 2+2.\n</think>\n\nIt is 4.", "The user asks 2+2.\n", "It is 4."),
    ("qwen3", "It is 4.", None, "It is 4."),
    ("qwen3", "  <think>short</think>answer", "short", "answer"),
    ("qwen3", "<thinking is not a tag", None, "<thinking is not a tag"),
    ("qwen3", "<think>never closed", "never closed", ""),
    ("deepseek-r1", "Let me see: 2+2.</think>It is 4.", "Let me see: 2+2.", "It is 4."),
    ("deepseek-r1", "still thinking </thi", "still thinking </thi", ""),
    ("deepseek-r1", "</think>direct", None, "direct"),
]


@pytest.mark.parametrize(("kind", "text", "reasoning", "content"), CASES)
def test_whole(kind, text, reasoning, content):
    assert split_reasoning(kind, text) == (reasoning, content)


@pytest.mark.parametrize(("kind", "text", "reasoning", "content"), CASES)
def test_streamed(kind, text, reasoning, content):
    rng = random.Random(text)
    for _ in range(30):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 10))))
        stream = ReasoningStream(kind)
        r = c = ""
        for a, b in zip([0, *cuts], [*cuts, len(text)]):
            dr, dc = stream.feed(text[a:b])
            assert "</think>" not in dr  # a closing tag never leaks into the reasoning
            r, c = r + dr, c + dc
        fr, fc = stream.finish()
        assert (r + fr or None, c + fc) == (reasoning, content)
