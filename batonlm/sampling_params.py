"""Per-request sampling parameters (SGLang names), shared by the frontend and the scheduler."""

from __future__ import annotations

import math
import re
from typing import Any

import msgspec

MAX_TOP_LOGPROBS = 20


class InvalidSamplingParams(ValueError):
    """A sampling parameter is out of range; `field` names it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    stop_token_ids: list[int] = msgspec.field(default_factory=list)
    ignore_eos: bool = False
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = msgspec.field(default_factory=dict)
    # None: no logprobs; n >= 0: the chosen token's logprob and the n most likely alternatives.
    logprobs: int | None = None

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> SamplingParams:
        """Build from user input; an unknown or mistyped key raises naming it."""
        if data is None:
            return cls()
        if not isinstance(data, dict):
            raise InvalidSamplingParams("sampling_params", f"must be a dict, got {type(data).__name__}")
        fields = set(cls.__struct_fields__)
        for key in data:
            if key not in fields:
                raise InvalidSamplingParams(key, f"unknown sampling parameter (known: {', '.join(sorted(fields))})")
        try:
            params = msgspec.convert(data, cls, strict=False)
        except msgspec.ValidationError as e:
            m = re.search(r"\$\.([A-Za-z_]+)", str(e))
            raise InvalidSamplingParams(m.group(1) if m else "sampling_params", str(e)) from None
        params.validate()
        return params

    def validate(self, vocab_size: int | None = None) -> None:
        if self.max_new_tokens < 1:
            raise InvalidSamplingParams("max_new_tokens", f"must be at least 1, got {self.max_new_tokens}")
        if not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise InvalidSamplingParams(
                "min_new_tokens",
                f"must be in [0, max_new_tokens={self.max_new_tokens}], got {self.min_new_tokens}",
            )
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise InvalidSamplingParams("temperature", f"must be finite and >= 0, got {self.temperature}")
        if not (0 < self.top_p <= 1):
            raise InvalidSamplingParams("top_p", f"must be in (0, 1], got {self.top_p}")
        if not (self.top_k == -1 or self.top_k >= 1):
            raise InvalidSamplingParams("top_k", f"must be -1 (disabled) or >= 1, got {self.top_k}")
        if not (0 <= self.min_p <= 1):
            raise InvalidSamplingParams("min_p", f"must be in [0, 1], got {self.min_p}")
        if self.seed is not None and not -(2**63) <= self.seed < 2**64:
            raise InvalidSamplingParams("seed", "must fit in 64 bits")
        for name in ("frequency_penalty", "presence_penalty"):
            v = getattr(self, name)
            if not (math.isfinite(v) and -2.0 <= v <= 2.0):
                raise InvalidSamplingParams(name, f"must be in [-2, 2], got {v}")
        if not (math.isfinite(self.repetition_penalty) and 0 < self.repetition_penalty <= 10):
            raise InvalidSamplingParams("repetition_penalty", f"must be in (0, 10], got {self.repetition_penalty}")
        for tok, bias in self.logit_bias.items():
            if not (math.isfinite(bias) and -100 <= bias <= 100):
                raise InvalidSamplingParams("logit_bias", f"bias of token {tok} must be in [-100, 100], got {bias}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidSamplingParams("logprobs", f"must be in [0, {MAX_TOP_LOGPROBS}], got {self.logprobs}")
        if vocab_size is not None:
            for name, ids in (("stop_token_ids", self.stop_token_ids), ("logit_bias", list(self.logit_bias))):
                bad = [t for t in ids if not 0 <= t < vocab_size]
                if bad:
                    raise InvalidSamplingParams(name, f"ids {bad[:5]} are outside the vocabulary [0, {vocab_size})")
