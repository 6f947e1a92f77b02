"""Messages between the scheduler and the CPU device worker process (launches and results)."""

from __future__ import annotations

import msgspec

from batonlm.sampling_params import LogitChanges, SamplingParams


class SlotSampling(msgspec.Struct, array_like=True, frozen=True):
    """A request's sampling record, sent to the device once, when the request starts on
    `req_slot`: its SamplingParams plus what the scheduler resolved for it."""

    req_slot: int
    params: SamplingParams
    seed: int  # the request's own seed, or one the scheduler drew for it (any 64-bit value)
    stop_ids: list[int]  # EOS + stop_token_ids: suppressed while under params.min_new_tokens
    prompt_len: int
    # With penalties: the whole prompt (the repetition penalty's mask), and the outputs a
    # retracted request had before it resumes (the token counts); empty without penalties.
    prompt_ids: list[int]
    output_ids: list[int]


class BatchLaunch(msgspec.Struct, tag=True, frozen=True):
    """One forward pass. Rows with `from_future` take their single input token from the
    FutureMap; the others take theirs, in row order, from the flat `input_ids`."""

    batch_id: int
    req_slots: list[int]
    prefix_lens: list[int]
    extend_lens: list[int]
    from_future: list[bool]
    input_ids: list[int]
    out_cache_loc: list[int]
    new_slots: list[SlotSampling]
    all_greedy: bool
    logit_changes: LogitChanges  # the most any row needs: none, logit bias alone, counted penalties
    # False defers sampling to a later `SampleLaunch` (grammar masks need the newest state).
    sample: bool = True
    # Largest number of top alternatives any row wants with its logprobs; -1: no logprobs.
    top_logprobs: int = -1
    # (request slot, KV slots of positions 0..n-1): a request starting on a cached prefix.
    table_writes: list[tuple[int, list[int]]] = msgspec.field(default_factory=list)
    # The rows whose sampled token is an output (None: all); a chunk that does not finish its
    # prompt samples a token nobody uses.
    output_rows: list[int] | None = None
    # Prompt logprobs: the flat token indices whose logits score the next prompt token, those
    # tokens, and the most alternatives any row wants (-1: none asked).
    prompt_logprob_at: list[int] = msgspec.field(default_factory=list)
    prompt_logprob_targets: list[int] = msgspec.field(default_factory=list)
    prompt_top_logprobs: int = -1
    # Embeddings: (first flat token index, count) of each span whose final hidden states (after
    # the final norm) the device sums in float32; a last-token pooled row is a span of one.
    pool_spans: list[tuple[int, int]] = msgspec.field(default_factory=list)
    # LoRA: each launch row's adapter slot (0: the base model); empty when every row is the base's.
    lora_slots: list[int] = msgspec.field(default_factory=list)
    # LongRoPE: each launch row's rotation regime (True: the long factors at every position, its
    # request longer than the original context); empty when every row is short.
    long_rope: list[bool] = msgspec.field(default_factory=list)
    # Speculative decoding: (first row, rows) of each verifying request, one decode row per
    # position (its newest output, then its drafts); drafts are accepted while they equal the
    # token the row before samples, and the request's token is the one after them.
    verify_groups: list[tuple[int, int]] = msgspec.field(default_factory=list)
    # DP attention: every data-parallel rank's token count this iteration (the sync row's).
    dp_tokens: list[int] | None = None


class IdleLaunch(msgspec.Struct, tag=True, frozen=True):
    """DP attention: this rank has no batch this iteration, others do; its device takes part in
    their MLPs (`dp_tokens`: every rank's token count). No result."""

    dp_tokens: list[int]


class LoRALoad(msgspec.Struct, tag=True, frozen=True):
    """Read a LoRA adapter (a PEFT directory, checked by the frontend) into host memory as load
    `key`; no result. The LoRA messages are ordered with the launches."""

    key: int
    name: str
    path: str


class LoRAPlace(msgspec.Struct, tag=True, frozen=True):
    """Copy adapter load `key` (held in host memory) into device slot `slot`, over what it held:
    after the launches before it (which may still use the slot), before those after it."""

    slot: int
    key: int


class LoRADrop(msgspec.Struct, tag=True, frozen=True):
    """Forget adapter load `key` (unloaded): its host memory is freed."""

    key: int


LoRAMessage = LoRALoad | LoRAPlace | LoRADrop


class SampleLaunch(msgspec.Struct, tag=True, frozen=True):
    """Delayed sampling of a launched batch; `banned` maps row -> token ids masked out, and
    grammar masks allow only their tokens in `mask_rows`: `bitmask` holds one int32 row
    ([mask_words] words, native byte order) per mask row (batonlm.kernels.token_bitmask)."""

    batch_id: int
    banned: dict[int, list[int]] = msgspec.field(default_factory=dict)
    mask_rows: list[int] = msgspec.field(default_factory=list)
    mask_words: int = 0
    bitmask: bytes = b""


class BatchResult(msgspec.Struct, tag=True, frozen=True):
    """A launch's sampled tokens, per launch row: the one record from the device to the
    scheduler (sent over the CPU worker's pipe, or handed over in-process)."""

    batch_id: int
    token_ids: list[int]
    logprobs: SampledLogprobs | None = None
    # One entry per `BatchLaunch.prompt_logprob_at`, in its order.
    prompt_logprobs: SampledLogprobs | None = None
    # Per verify group: the drafts accepted.
    accepted: list[int] | None = None
    # One sum of final hidden states per `BatchLaunch.pool_spans`, in its order.
    pooled: list[list[float]] | None = None
    # Seconds the device spent computing this batch (forward + sampling), where it can tell.
    compute_s: float = 0.0


class SampledLogprobs(msgspec.Struct, array_like=True, frozen=True):
    """Per row (or scored prompt position): the chosen token's logprob and the `top_logprobs`
    best alternatives."""

    chosen: list[float]
    top_ids: list[list[int]]
    top_logprobs: list[list[float]]


class WorkerFailed(msgspec.Struct, tag=True, frozen=True):
    batch_id: int
    message: str


class WorkerProgress(msgspec.Struct, tag=True, frozen=True):
    """A start-up step the worker is in (compiling the decode step takes a while)."""

    message: str


class WorkerReady(msgspec.Struct, tag=True, frozen=True):
    pass


class WorkerShutdown(msgspec.Struct, tag=True, frozen=True):
    pass


class WorkerAlive(msgspec.Struct, tag=True, frozen=True):
    """A rank on a node other than 0 tells its node's supervisor it still follows the relay."""
