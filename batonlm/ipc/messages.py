"""Messages between the frontend (main process) and the scheduler process."""

from __future__ import annotations

from typing import Literal

import msgspec

from batonlm.sampling_params import SamplingParams

# How an embedding request pools its prompt's last hidden states: the last token's, or the mean.
Pooling = Literal["last", "mean"]


class GenerateRequest(msgspec.Struct, tag=True, frozen=True):
    rid: str
    input_ids: list[int]
    sampling_params: SamplingParams
    priority: int = 0  # lower values first (--schedule-policy priority)
    # An embedding request: its prompt's hidden states pooled so (its one sampled token is
    # dropped by the frontend), sent with its output as `TokenOutput.embedding`.
    pooling: Pooling | None = None
    # The LoRA adapter's load (--lora-paths: 1, 2, ... in order; run-time loads after them; 0: the
    # base model). An adapter unloaded before the request reached the scheduler: refused.
    lora_key: int = 0


class AbortRequest(msgspec.Struct, tag=True, frozen=True):
    rid: str


class StatsRequest(msgspec.Struct, tag=True, frozen=True):
    """Ask the scheduler for a `SchedulerStats` snapshot."""


class ShutdownRequest(msgspec.Struct, tag=True, frozen=True):
    pass


class FlushCacheRequest(msgspec.Struct, tag=True, frozen=True):
    """Empty the prefix cache (refused while requests run); answered with FlushCacheResult."""


class LoadLoRARequest(msgspec.Struct, tag=True, frozen=True):
    """Load a LoRA adapter (checked by the frontend) at run time, as load `key` (unique: the
    prefix cache keys its KV by it); answered with LoRAResult."""

    key: int
    name: str
    path: str


class UnloadLoRARequest(msgspec.Struct, tag=True, frozen=True):
    """Forget LoRA adapter load `key` (no request of it runs: the frontend checked); answered
    with LoRAResult."""

    key: int


class LoRAResult(msgspec.Struct, tag=True, frozen=True):
    ok: bool
    message: str
    dp_rank: int = 0


class FlushCacheResult(msgspec.Struct, tag=True, frozen=True):
    ok: bool
    message: str
    dp_rank: int = 0  # the replica that answered


# TokenOutput.error_about of an error about the request's constraint (response_format, regex,
# ebnf, a forced tool call's schema): it did not compile, admits no text, or reached a dead end.
ABOUT_CONSTRAINT = "constraint"


class TokenOutput(msgspec.Struct, array_like=True, frozen=True):
    """New tokens of one request in one iteration; `finish_reason` set on its last one.

    `finish_reason` is "stop", "length" or "abort"; `error` explains an abort the scheduler
    decided (a request it rejected), and is None for a client's own abort; `error_about` says
    which part of the request the error is about, where the scheduler knows ("constraint": the
    frontend names the field the constraint came from).
    """

    rid: str
    token_ids: list[int]
    finish_reason: str | None = None
    error: str | None = None
    # With logprobs requested: per new token, its logprob and the top alternatives (id, logprob).
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    # With a request's first token: how many of its prompt tokens the prefix cache served, and
    # the seconds it waited in the scheduler before its first admission.
    cached_tokens: int | None = None
    queued_s: float | None = None
    # With prompt logprobs asked, on the first output: one per prompt position from the
    # request's logprob_start_len on (None for position 0), and the top alternatives.
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]]] | None = None
    # With its last output, for a request that verified drafts: (verification steps, drafts accepted).
    spec: tuple[int, int] | None = None
    preemptions: int = 0  # with its last output: the times it was retracted for a request of higher priority
    # An embedding request's pooled last hidden states (not normalised), with its output.
    embedding: list[float] | None = None
    error_about: str | None = None


def merge_outputs(outs: list[TokenOutput]) -> TokenOutput:
    """Consecutive outputs of one request as one: tokens and their logprobs in order; what comes
    with the first output (cached tokens, queue time, prompt logprobs) from the first, what comes
    with the last (finish, error and what it is about, speculative counts, preemptions, embedding) from the last."""
    first, last = outs[0], outs[-1]
    with_lp = all(o.logprobs is not None for o in outs)
    with_top = all(o.top_logprobs is not None for o in outs)
    return TokenOutput(
        first.rid, [t for o in outs for t in o.token_ids], last.finish_reason, last.error,
        [lp for o in outs for lp in o.logprobs] if with_lp else None,  # type: ignore[union-attr]
        [tl for o in outs for tl in o.top_logprobs] if with_top else None,  # type: ignore[union-attr]
        first.cached_tokens, first.queued_s, first.prompt_logprobs, first.prompt_top_logprobs,
        last.spec, last.preemptions, last.embedding, last.error_about,
    )


class BatchOutput(msgspec.Struct, tag=True, frozen=True):
    """Everything that advanced in one scheduler iteration (none: a heartbeat, the scheduler is
    busy and making progress: a long prefill emits no token for a while)."""

    outputs: list[TokenOutput]
    dp_rank: int = 0  # the replica that sent it


class SchedulerInfo(msgspec.Struct, tag=True, frozen=True):
    """Sent once when the scheduler is ready: the limits the frontend validates against."""

    model_path: str
    context_length: int
    vocab_size: int
    kv_capacity: int
    device: str
    dtype: str
    overlap: bool
    model_impl: str = "native"  # or "transformers" (the fallback)
    # A checkpoint without its LM head (an embedding model, e.g. Qwen3Model): embeddings only.
    embedding_only: bool = False
    hidden_size: int = 0  # an embedding's length
    quantization: str = ""  # the weights' quantization, described ("": float weights)
    kv_bytes: int = 0  # the KV pool's memory on one device (a CPU commits only the slots written)
    worker_cpus: list[int] = msgspec.field(default_factory=list)  # the CPU device worker's own cores (none: any)


class SchedulerStats(msgspec.Struct, tag=True, frozen=True):
    num_running: int
    num_waiting: int  # for room in the batch (constrained requests compiling their grammar: below)
    kv_used: int  # held by running requests, or cached and locked by them
    kv_capacity: int
    kv_evictable: int  # cached and evictable
    cached_prompt_tokens: int  # of the prompt tokens admitted, those the prefix cache served
    admitted_prompt_tokens: int
    retractions: int
    req_slots_used: int
    req_slots_total: int
    iterations: int
    prompt_tokens: int
    generated_tokens: int
    # Cumulative loop timing (seconds): the scheduler's own CPU work, its waits on the device,
    # and (CPU device only) the worker's compute; batches counts forward passes.
    scheduler_cpu_s: float = 0.0
    device_wait_s: float = 0.0
    device_compute_s: float = 0.0
    batches: int = 0
    # LoRA: adapters copied into a device slot since start (beyond the --lora-paths ones placed
    # at start): with fewer slots than loaded adapters, how often they took turns.
    lora_placements: int = 0
    # Speculative decoding: verification steps (one per verifying request and step), the drafts
    # they checked and accepted, and how many steps accepted 0, 1, ... K drafts.
    spec_verify_steps: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_accept_hist: list[int] = msgspec.field(default_factory=list)
    num_compiling: int = 0  # constrained requests waiting for their grammar to compile
    dp_rank: int = 0  # the replica that answered (the frontend sums the replicas' stats)
    # DP attention: iterations this replica ran idle/extend/decode (row) beside another replica
    # running idle/extend/decode (column), 3x3 row-major; overlap decisions checked equal.
    dp_pairings: list[int] = msgspec.field(default_factory=list)
    dp_decisions_checked: int = 0
    # --schedule-policy priority: requests retracted for one of higher priority, by their priority.
    preemptions: dict[str, int] = msgspec.field(default_factory=dict)


class SchedulerFailed(msgspec.Struct, tag=True, frozen=True):
    """The scheduler is going down because of an internal error."""

    message: str
