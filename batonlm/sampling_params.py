"""Per-request sampling parameters (SGLang names): the one record a request's sampling travels
in, from the frontend through the scheduler to the device.

The value range of every field is stated here, once, as a msgspec constraint: `from_dict` checks
them (the native API and the Python Engine), the OpenAI request models take their bounds from
here (`field_range`), and the scheduler's decoder enforces them again for free when a request
crosses into its process. `check_relations` adds what one field's range cannot say.
"""

from __future__ import annotations

import enum
import re
from typing import Annotated, Any, Literal, TypedDict

import msgspec
from msgspec import Meta

MAX_TOP_LOGPROBS = 20
# Integer fields that end up in int64 device tables, or in int32 kernel arguments, stay below this.
MAX_INT32 = 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1

TokenId = Annotated[int, Meta(ge=0, le=MAX_INT32)]


class LogitChanges(enum.IntEnum):
    """What sampling does to a row's logits before drawing, cheapest first: a batch does what
    its most costly row needs (the largest of its rows')."""

    NONE = 0
    BIAS = 1  # logit bias alone: added, no token counts
    COUNTED = 2  # a frequency, presence or repetition penalty (and any bias): one pass over the count tables


class InvalidSamplingParams(ValueError):
    """A sampling parameter is invalid; `field` names it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message

    def nested(self, parent: str) -> InvalidSamplingParams:
        """The same error, its field named inside `parent` (e.g. sampling_params.top_k)."""
        return InvalidSamplingParams(f"{parent}.{self.field}", self.message)


GREEDY_BELOW = 1e-5


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    max_new_tokens: Annotated[int, Meta(ge=1, le=MAX_INT32)] = 128
    min_new_tokens: Annotated[int, Meta(ge=0, le=MAX_INT32)] = 0
    temperature: Annotated[float, Meta(ge=0.0, le=2.0)] = 1.0
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] = 1.0
    # -1 or 0: no top-k filtering. Values above the vocabulary size filter nothing.
    top_k: Annotated[int, Meta(ge=-1, le=MAX_INT32)] = -1
    min_p: Annotated[float, Meta(ge=0.0, le=1.0)] = 0.0
    seed: Annotated[int, Meta(ge=INT64_MIN, le=INT64_MAX)] | None = None
    stop_token_ids: list[TokenId] = msgspec.field(default_factory=list)
    ignore_eos: bool = False
    frequency_penalty: Annotated[float, Meta(ge=-2.0, le=2.0)] = 0.0
    presence_penalty: Annotated[float, Meta(ge=-2.0, le=2.0)] = 0.0
    repetition_penalty: Annotated[float, Meta(gt=0.0, le=10.0)] = 1.0
    logit_bias: dict[TokenId, Annotated[float, Meta(ge=-100.0, le=100.0)]] = msgspec.field(default_factory=dict)
    # None: no logprobs; n >= 0: the chosen token's logprob and the n most likely alternatives.
    logprobs: Annotated[int, Meta(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    # Prompt logprobs (vLLM's prompt_logprobs, SGLang's logprob_start_len): None: none; n >= 0:
    # the logprob of every prompt token from position logprob_start_len on (position 0 has none:
    # nothing precedes it) under the raw model distribution, and its n most likely alternatives.
    prompt_logprobs: Annotated[int, Meta(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    logprob_start_len: Annotated[int, Meta(ge=0, le=MAX_INT32)] = 0
    # Constrained decoding, at most one (batonlm.constrained): a JSON schema as JSON text, a
    # regular expression, an EBNF grammar (SGLang's names).
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None

    @property
    def is_greedy(self) -> bool:
        # Under GREEDY_BELOW, logits / temperature overflow float32 (a logit of 10 / 1e-45 is inf,
        # and softmax of infs is NaN); such a temperature draws the argmax anyway (vLLM's rule too).
        return self.temperature < GREEDY_BELOW or self.top_k == 1

    @property
    def constraint(self) -> tuple[str, str] | None:
        """(kind, text) of the request's constraint, if it has one."""
        for kind in ("json_schema", "regex", "ebnf"):
            text = getattr(self, kind)
            if text is not None:
                return kind, text
        return None

    def for_choices(self, n: int) -> list[SamplingParams]:
        """The records of n choices: a seeded request's choice i uses seed + i (wrapped into
        the int64 range), so its choices differ and each is reproducible."""
        if self.seed is None:
            return [self] * n
        return [msgspec.structs.replace(self, seed=(self.seed + i + 2**63) % 2**64 - 2**63) for i in range(n)]

    @property
    def logit_changes(self) -> LogitChanges:
        """What sampling does to this request's logits before drawing (LogitChanges)."""
        if self.counts_tokens:
            return LogitChanges.COUNTED
        return LogitChanges.BIAS if self.logit_bias else LogitChanges.NONE

    @property
    def counts_tokens(self) -> bool:
        """Whether sampling needs the per-slot penalty tables (token counts, prompt mask): a
        frequency, presence or repetition penalty (logit bias alone does not)."""
        return bool(self.frequency_penalty or self.presence_penalty or self.repetition_penalty != 1.0)

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> SamplingParams:
        """Build from user input (JSON types: token-id keys of logit_bias may be strings); an
        unknown, mistyped or out-of-range field raises InvalidSamplingParams naming it."""
        if data is None:
            return cls()
        if not isinstance(data, dict):
            raise InvalidSamplingParams("sampling_params", f"must be an object, got {type(data).__name__}")
        fields = cls.__struct_fields__
        for key in data:
            if key not in fields:
                raise InvalidSamplingParams(str(key), f"unknown sampling parameter (known: {', '.join(sorted(fields))})")
        bias = data.get("logit_bias")
        if isinstance(bias, dict):
            data = {**data, "logit_bias": {_token_key(k): v for k, v in bias.items()}}
        try:
            params = msgspec.convert(data, cls, strict=True)
        except msgspec.ValidationError as e:
            raise from_validation_error(e) from None
        params.check_relations()
        return params

    def check_relations(self, vocab_size: int | None = None) -> None:
        """What the per-field ranges cannot say: between fields, and against the vocabulary."""
        if self.min_new_tokens > self.max_new_tokens:
            raise InvalidSamplingParams(
                "min_new_tokens", f"must be at most max_new_tokens ({self.max_new_tokens}), got {self.min_new_tokens}"
            )
        if self.logprob_start_len and self.prompt_logprobs is None:
            raise InvalidSamplingParams("logprob_start_len", "needs prompt_logprobs")
        given = [k for k in ("json_schema", "regex", "ebnf") if getattr(self, k) is not None]
        if len(given) > 1:
            raise InvalidSamplingParams(given[1], f"give at most one constraint, got {' and '.join(given)}")
        if vocab_size is not None:
            for name, ids in (("stop_token_ids", self.stop_token_ids), ("logit_bias", list(self.logit_bias))):
                bad = [t for t in ids if t >= vocab_size]
                if bad:
                    raise InvalidSamplingParams(name, f"ids {bad[:5]} are outside the vocabulary [0, {vocab_size})")


def _token_key(key: Any) -> Any:
    """JSON object keys are strings: "42" -> 42 (anything else is left for the range check)."""
    if isinstance(key, str) and re.fullmatch(r"-?[0-9]{1,19}", key):
        return int(key)
    return key


_FIELD_AT = re.compile(r"`\$\.([A-Za-z_]+)")
_BOUND = re.compile(r"Expected `\w+` ([<>]=? \S+)")


def from_validation_error(e: msgspec.ValidationError) -> InvalidSamplingParams:
    """msgspec's "Expected `float` <= 2.0 - at `$.temperature`" as an error naming the field."""
    text = str(e)
    m = _FIELD_AT.search(text)
    message = text.split(" - at ", 1)[0]
    bound = _BOUND.fullmatch(message)
    return InvalidSamplingParams(m.group(1) if m else "sampling_params", f"must be {bound.group(1)}" if bound else message)


class Bounds(TypedDict, total=False):
    """Keyword arguments of a pydantic Field that bound a number."""

    ge: float
    gt: float
    le: float
    lt: float


_BOUND_NAMES: tuple[Literal["ge", "gt", "le", "lt"], ...] = ("ge", "gt", "le", "lt")


def field_range(name: str) -> Bounds:
    """The bounds of a field (of its values, for a list or dict) as keyword arguments for a
    pydantic Field: ge, gt, le, lt."""
    mi = msgspec.inspect
    info = mi.type_info(SamplingParams)
    assert isinstance(info, mi.StructType)
    kind = next(f for f in info.fields if f.name == name).type
    if isinstance(kind, mi.UnionType):  # X | None
        kind = next(t for t in kind.types if not isinstance(t, mi.NoneType))
    if isinstance(kind, mi.ListType):
        kind = kind.item_type
    elif isinstance(kind, mi.DictType):
        kind = kind.value_type
    bounds = Bounds()
    for k in _BOUND_NAMES:
        if (value := getattr(kind, k, None)) is not None:
            bounds[k] = value
    return bounds
