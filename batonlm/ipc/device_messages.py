"""Messages between the scheduler and the CPU device worker process (launches and results)."""

from __future__ import annotations

import msgspec


class SlotInit(msgspec.Struct, array_like=True, frozen=True):
    """Sampling state of a request starting on `req_slot`, kept device-side for its lifetime."""

    req_slot: int
    prompt_len: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int  # unsigned 64-bit
    min_new_tokens: int
    # Ids suppressed while fewer than `min_new_tokens` tokens have been generated.
    stop_ids: list[int]
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = msgspec.field(default_factory=dict)


class BatchLaunch(msgspec.Struct, tag=True, frozen=True):
    """One forward pass. Rows with `from_future` take their single input token from the
    FutureMap; the others take theirs, in row order, from the flat `input_ids`."""

    batch_id: int
    mode: int
    req_slots: list[int]
    prefix_lens: list[int]
    extend_lens: list[int]
    from_future: list[bool]
    input_ids: list[int]
    out_cache_loc: list[int]
    new_slots: list[SlotInit]
    all_greedy: bool
    # False defers sampling to a later `SampleLaunch` (grammar masks need the newest state).
    sample: bool = True
    # Largest number of top alternatives any row wants with its logprobs; -1: no logprobs.
    top_logprobs: int = -1


class SampleLaunch(msgspec.Struct, tag=True, frozen=True):
    """Delayed sampling of a launched batch; `banned` maps row -> token ids masked out."""

    batch_id: int
    banned: dict[int, list[int]] = msgspec.field(default_factory=dict)


class BatchSampled(msgspec.Struct, tag=True, frozen=True):
    batch_id: int
    token_ids: list[int]
    # Seconds the worker spent computing this batch (forward + sampling), for profiling.
    compute_s: float = 0.0
    logprobs: SampledLogprobs | None = None


class SampledLogprobs(msgspec.Struct, array_like=True, frozen=True):
    """Per row: the chosen token's logprob and the `top_logprobs` best alternatives."""

    chosen: list[float]
    top_ids: list[list[int]]
    top_logprobs: list[list[float]]


class WorkerFailed(msgspec.Struct, tag=True, frozen=True):
    batch_id: int
    message: str


class WorkerReady(msgspec.Struct, tag=True, frozen=True):
    dtype: str


class WorkerShutdown(msgspec.Struct, tag=True, frozen=True):
    pass
