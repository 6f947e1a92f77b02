"""Benchmark prompts: slices of the bundled story corpus, measured in the target model's tokens.

Three datasets, chosen by name from `DATASETS`:
* `random`: independent prompts of a drawn number of tokens each.
* `shared-prefix`: `groups` long system prompts; each group's requests share its prompt and add
  a question of their own (the pattern prefix caches are built for). Requests are shuffled.
* `sharegpt`: real conversations from a ShareGPT-format JSON file (`dataset_path`), replayed as
  SGLang's and vLLM's bench_serving do: the first user turn is the prompt, the reply's length
  (in the target's tokens) the output length.
Input and output lengths of the synthetic ones are drawn uniformly from [len * range_ratio, len].
"""

from __future__ import annotations

import functools
import logging
import random
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

logger = logging.getLogger(__name__)

CORPUS_PATH = str(Path(__file__).resolve().parent / "data" / "corpus.txt")
PREFIX_SEPARATOR = "\n\n"


class TextTokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: list[int]) -> str: ...


class HFTokenizer:
    """A transformers tokenizer without special tokens: lengths count only the text."""

    def __init__(self, path: str) -> None:
        from transformers import AutoTokenizer

        self.path = path
        self._tok = AutoTokenizer.from_pretrained(path)
        self._tok.model_max_length = sys.maxsize  # the corpus is encoded whole; this is no model input

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        text = self._tok.decode(ids, skip_special_tokens=True)
        assert isinstance(text, str)  # a list only for a batch of id lists
        return text


@functools.lru_cache(maxsize=4)
def load_tokenizer(path: str) -> HFTokenizer:
    logger.info("measuring prompt lengths with the tokenizer at %s", path)
    return HFTokenizer(path)


@dataclass(frozen=True)
class BenchRequest:
    """One request to send. `prompt_len` counts the tokens of the completions prompt."""

    index: int
    prompt: str
    output_len: int
    prompt_len: int
    prefix: str = ""
    group: int | None = None

    def completion_prompt(self) -> str:
        return self.prefix + PREFIX_SEPARATOR + self.prompt if self.prefix else self.prompt

    def chat_messages(self) -> list[dict[str, str]]:
        system = [{"role": "system", "content": self.prefix}] if self.prefix else []
        return [*system, {"role": "user", "content": self.prompt}]


@dataclass(frozen=True)
class DatasetSpec:
    num_prompts: int = 1000
    input_len: int = 1024
    output_len: int = 128
    range_ratio: float = 0.0
    prefix_groups: int = 8
    prefix_len: int = 2048
    prefix_questions: int = 16
    seed: int = 0
    dataset_path: str | None = None  # sharegpt: the JSON file
    sharegpt_output_len: int | None = None  # sharegpt: every output this long (None: the reply's)
    sharegpt_context_len: int = 2048  # sharegpt: conversations whose prompt + reply exceed this are skipped

    def __post_init__(self) -> None:
        for name in ("num_prompts", "input_len", "output_len", "prefix_groups", "prefix_len", "prefix_questions"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if not 0.0 <= self.range_ratio <= 1.0:
            raise ValueError(f"range_ratio must be in [0, 1], got {self.range_ratio}")


class Corpus:
    """The corpus as one token stream; `sample` cuts a window of an exact token length."""

    def __init__(self, tokenizer: TextTokenizer, text: str | None = None) -> None:
        self.tokenizer = tokenizer
        if text is None:
            text = Path(CORPUS_PATH).read_text(encoding="utf-8")
        self.ids = tokenizer.encode(text)
        if len(self.ids) < 2:
            raise ValueError("the corpus is empty")

    def sample(self, rng: random.Random, n: int) -> tuple[str, int]:
        """Text of `n` tokens (re-encoded) from a random offset, and its measured length.

        Decoding then re-encoding can merge or split tokens at the edges, so the window is
        resized, and failing that moved, until the text re-encodes to exactly `n` tokens; if
        no window does, the longest shorter one (or else the shortest) is returned."""
        ids = self.ids
        while len(ids) < n + 1:  # a prompt longer than the corpus wraps around
            ids = ids + self.ids
        best: tuple[str, int] | None = None
        for _ in range(8):
            start = rng.randrange(len(ids) - n)
            width = n
            for _ in range(6):
                text = self.tokenizer.decode(ids[start : start + width])
                m = len(self.tokenizer.encode(text))
                if m == n:
                    return text, m
                if best is None or (m < n and (best[1] > n or m > best[1])) or (m > n and best[1] > m):
                    best = (text, m)
                width = max(1, min(len(ids) - start, width + n - m))
        assert best is not None
        return best


def draw_len(rng: random.Random, length: int, ratio: float) -> int:
    """A length uniform in [length * ratio, length], at least 1."""
    return rng.randint(max(1, int(length * ratio)), length)


def random_requests(corpus: Corpus, spec: DatasetSpec) -> list[BenchRequest]:
    rng = random.Random(spec.seed)
    out = []
    for i in range(spec.num_prompts):
        text, n = corpus.sample(rng, draw_len(rng, spec.input_len, spec.range_ratio))
        out.append(BenchRequest(i, text, draw_len(rng, spec.output_len, spec.range_ratio), n))
    return out


def shared_prefix_requests(corpus: Corpus, spec: DatasetSpec) -> list[BenchRequest]:
    rng = random.Random(spec.seed)
    items = []
    for g in range(spec.prefix_groups):
        prefix, _ = corpus.sample(rng, spec.prefix_len)
        for _ in range(spec.prefix_questions):
            question, _ = corpus.sample(rng, draw_len(rng, spec.input_len, spec.range_ratio))
            n = len(corpus.tokenizer.encode(prefix + PREFIX_SEPARATOR + question))
            items.append((g, prefix, question, n, draw_len(rng, spec.output_len, spec.range_ratio)))
    rng.shuffle(items)
    return [BenchRequest(i, q, out, n, prefix=p, group=g) for i, (g, p, q, n, out) in enumerate(items)]


SHAREGPT_MIN_TOKENS = 4  # shorter prompts or replies are skipped (bench_serving's filter)


def sharegpt_requests(corpus: Corpus, spec: DatasetSpec) -> list[BenchRequest]:
    """Conversations of a ShareGPT file ([{"conversations": [{"from": "human"|"gpt", "value": ...}, ...]}]),
    shuffled with the seed; the first `num_prompts` that pass the filters."""
    import json

    if spec.dataset_path is None:
        raise ValueError("the sharegpt dataset needs --dataset-path FILE (a ShareGPT-format JSON file)")
    try:
        data = json.loads(Path(spec.dataset_path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read the ShareGPT file {spec.dataset_path!r}: {e}") from None
    if not isinstance(data, list):
        raise ValueError(f"{spec.dataset_path!r} is not a ShareGPT file: expected a JSON list of conversations")
    pairs = []
    for conv in data:
        turns = conv.get("conversations") if isinstance(conv, dict) else None
        if not isinstance(turns, list) or len(turns) < 2:
            continue
        first, reply = turns[0], turns[1]
        if not all(isinstance(t, dict) and isinstance(t.get("value"), str) for t in (first, reply)):
            continue
        pairs.append((first["value"], reply["value"]))
    random.Random(spec.seed).shuffle(pairs)
    out: list[BenchRequest] = []
    for prompt, reply in pairs:
        if len(out) == spec.num_prompts:
            break
        n = len(corpus.tokenizer.encode(prompt))
        m = spec.sharegpt_output_len or len(corpus.tokenizer.encode(reply))
        if n < SHAREGPT_MIN_TOKENS or m < SHAREGPT_MIN_TOKENS or n + m > spec.sharegpt_context_len:
            continue
        out.append(BenchRequest(len(out), prompt, m, n))
    if not out:
        raise ValueError(f"no conversation of {spec.dataset_path!r} passed the filters (two turns, each at least "
                         f"{SHAREGPT_MIN_TOKENS} tokens, together at most {spec.sharegpt_context_len})")
    if len(out) < spec.num_prompts:
        logger.warning("the ShareGPT file has %d usable conversations, fewer than the %d asked for", len(out),
                       spec.num_prompts)
    return out


DATASETS: dict[str, Callable[[Corpus, DatasetSpec], list[BenchRequest]]] = {
    "random": random_requests,
    "shared-prefix": shared_prefix_requests,
    "sharegpt": sharegpt_requests,
}


def build_requests(name: str, corpus: Corpus, spec: DatasetSpec) -> list[BenchRequest]:
    if name not in DATASETS:
        raise ValueError(f"unknown dataset {name!r} (known: {', '.join(DATASETS)})")
    return DATASETS[name](corpus, spec)
