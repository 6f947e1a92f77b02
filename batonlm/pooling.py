"""Embeddings' pooling, shared by `/v1/embeddings` and `Engine.embed`: which pooling a model
gets (`--pooling`, auto: its sentence-transformers config), and a pooled vector's finish
(Matryoshka truncation, L2 normalisation, float32). The pooling itself runs in the scheduler
and on the device (`GenerateRequest.pooling`)."""

from __future__ import annotations

import array
import functools
import json
import logging
import math
from pathlib import Path

from batonlm.ipc.messages import Pooling

logger = logging.getLogger(__name__)


@functools.cache
def pooling_of(setting: str, model_dir: str) -> Pooling:
    """`--pooling` resolved: auto reads the sentence-transformers pooling config beside the
    model (1_Pooling/config.json: pooling_mode_lasttoken or pooling_mode_mean_tokens), else last."""
    if setting in ("last", "mean"):
        return "last" if setting == "last" else "mean"
    try:
        config = json.loads((Path(model_dir) / "1_Pooling" / "config.json").read_text())
    except (OSError, ValueError):
        return "last"
    if config.get("pooling_mode_mean_tokens"):
        return "mean"
    if not config.get("pooling_mode_lasttoken"):
        modes = sorted(k for k, v in config.items() if k.startswith("pooling_mode_") and v)
        logger.warning("the model's pooling config asks for %s, which batonlm does not have: pooling the last token "
                       "(--pooling last or mean to choose)", ", ".join(modes) or "nothing")
    return "last"


def finish_vector(values: list[float], dimensions: int | None = None, normalize: bool = True) -> array.array:
    """The first `dimensions` values (all: None), L2-normalised, as float32."""
    kept = values[:dimensions] if dimensions is not None else values
    norm = math.sqrt(math.fsum(v * v for v in kept)) if normalize else 0.0
    return array.array("f", [v / norm for v in kept] if norm > 0 else kept)
