"""Regenerate `data/corpus.txt`: short children's stories sampled from the embedded stories260K.

Run `python -m batonlm.bench.make_corpus [--target-kb 320] [--seed 0]`. The output is
deterministic for a given seed, engine and torch build. See `data/README.md` for the license.
"""

from __future__ import annotations

import argparse
import logging
import random
import re
from pathlib import Path

from batonlm.bench.datasets import CORPUS_PATH

logger = logging.getLogger(__name__)

OPENERS = (
    "Once upon a time", "One day", "Once upon a time, there was a little girl named",
    "Once upon a time, there was a little boy named", "Tom and Sue", "Lily and Ben",
    "There was a big dog", "The sun was shining", "In a small house", "A little bird",
    "Mom said", "It was a rainy day", "Tim had a red ball", "Sara liked to", "The cat",
    "One morning", "Max was a", "In the park", "Anna found a box", "A girl named Mia",
    "The little fish", "Grandpa had", "At school", "Jack wanted to", "The old tree",
    "Emma and her dad", "Spot the dog", "A big truck", "The princess", "Bob the bear",
    "It was a sunny day", "The moon", "Sam and his friend", "Lucy saw a", "The farmer",
    "Once there was a happy", "A small mouse", "The boat", "Ben was sad because", "Kitty",
)


def _clean(text: str) -> str:
    text = re.sub(r"[^\x20-\x7e\n]", "", text)  # byte-fallback fragments decode to U+FFFD
    text = re.sub(r"\n+", "\n", text).strip()
    # Drop a trailing unfinished sentence left by the token limit.
    end = max(text.rfind("."), text.rfind("!"), text.rfind("?"), text.rfind('"'))
    return text[: end + 1] if end > 0 else ""


def make_corpus(target_bytes: int, seed: int, batch: int = 32) -> str:
    import batonlm

    rng = random.Random(seed)
    stories: list[str] = []
    seen: set[str] = set()
    size = 0
    with batonlm.Engine() as engine:
        while size < target_bytes:
            openers = [rng.choice(OPENERS) for _ in range(batch)]
            params = [{"temperature": 0.9, "top_p": 0.95, "max_new_tokens": 440, "seed": rng.getrandbits(31)}
                      for _ in openers]
            for opener, out in zip(openers, engine.generate(openers, sampling_params=params), strict=True):
                story = _clean(opener + out["text"])
                if len(story) < 200 or story in seen:
                    continue
                seen.add(story)
                stories.append(story)
                size += len(story.encode()) + 2
            logger.info("%d stories, %d KB", len(stories), size // 1024)
    return "\n\n".join(stories) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target-kb", type=int, default=320)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", type=Path, default=Path(CORPUS_PATH))
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    args.output.write_text(make_corpus(args.target_kb * 1024, args.seed), encoding="utf-8")
    logger.info("wrote %s", args.output)


if __name__ == "__main__":
    main()
