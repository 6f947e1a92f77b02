"""Request: one generation as the scheduler tracks it."""

from __future__ import annotations

import time
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from batonlm.ipc.device_messages import SlotSampling
from batonlm.ipc.messages import TokenOutput
from batonlm.request_checks import kv_slots_needed
from batonlm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from batonlm.constrained.backend import GrammarMatcher
    from batonlm.scheduler.radix_cache import TreeNode
    from batonlm.scheduler.speculative import SpecState

FINISH_STOP = "stop"
FINISH_LENGTH = "length"
FINISH_ABORT = "abort"


class Request:
    """Prompt, outputs, slots and progress of one request.

    Positions 0..prompt_len-1 hold the prompt; output k (0-based) sits at prompt_len + k. While
    admitted, the request extends its KV to `fill_len` tokens (its prompt, or after a retraction
    its prompt and the outputs it had), a chunk per iteration, from `kv_len` (the positions
    whose KV is computed or launched: the cached prefix first); the launch that reaches
    `fill_len` samples the next output. Each decode then feeds the newest output at position
    kv_len and samples the one after. `output_ids` holds the outputs whose result was processed;
    `num_outputs_launched` counts those whose forward was launched (the two differ by the
    forwards in flight).
    """

    __slots__ = (
        "rid",
        "prompt_ids",
        "params",
        "seed",
        "max_new_tokens",
        "max_kv_len",
        "stop_ids",
        "output_ids",
        "req_slot",
        "kv_slots",
        "cached_len",
        "cache_node",
        "kv_len",
        "fill_len",
        "num_outputs_launched",
        "inflight",
        "finish_reason",
        "error",
        "error_about",
        "epoch",
        "first_cached_len",
        "waited",
        "slot_sent",
        "matcher",
        "grammar",
        "arrived",
        "queued_s",
        "prompt_lp",
        "prompt_top",
        "spec",
        "priority",
        "preemptions",
        "pooling",
        "pool_sum",
        "lora",
        "lora_key",
        "long_rope",
        "held",
    )

    def __init__(
        self, rid: str, prompt_ids: list[int], params: SamplingParams, seed: int, context_length: int,
        eos_ids: tuple[int, ...], priority: int = 0, pooling: str | None = None, lora_key: int = 0,
    ) -> None:
        self.rid = rid
        self.lora_key = lora_key  # its LoRA adapter's load (0: the base model; the prefix cache's namespace)
        self.lora = 0  # the device slot holding that adapter (set when admitted: lora_slots.py)
        # LongRoPE: rotated by the long factors at every position (set when admitted: its tokens
        # outnumber the original context); its KV is its own in the prefix cache.
        self.long_rope = False
        # An embedding request: "last" or "mean" pooling of its prompt's last hidden states,
        # summed (float32 per launch) into pool_sum as its chunks' results arrive.
        self.pooling = pooling
        self.pool_sum: list[float] | None = None
        self.priority = priority  # lower values first (--schedule-policy priority)
        self.preemptions = 0  # retracted for a request of higher priority
        self.held: list[TokenOutput] = []  # outputs not sent yet (--stream-interval)
        self.prompt_ids = prompt_ids
        self.params = params
        self.seed = seed
        # The last output may sit at position context_length - 1 at most.
        self.max_kv_len, self.max_new_tokens = kv_slots_needed(len(prompt_ids), params.max_new_tokens, context_length)
        stops = set(params.stop_token_ids)
        if not params.ignore_eos:
            stops.update(eos_ids)
        self.stop_ids = frozenset(stops)
        self.output_ids: list[int] = []
        self.req_slot: int | None = None
        # KV slot of each position 0..len-1: the cached prefix (owned by the radix cache, locked
        # by `cache_node`), then the request's own.
        self.kv_slots: list[int] = []
        self.cached_len = 0
        self.cache_node: TreeNode | None = None
        self.kv_len = 0
        self.fill_len = 0
        self.num_outputs_launched = 0
        self.inflight = 0
        self.finish_reason: str | None = None
        self.error: str | None = None  # why an aborted request ended (sent with its last output)
        self.error_about: str | None = None  # TokenOutput.error_about
        # Bumped by a retraction: results of launches from an earlier epoch are dropped.
        self.epoch = 0
        self.first_cached_len: int | None = None  # prompt tokens the cache served at first admission
        self.waited = 0  # iterations spent waiting (the LPM policy's age bound)
        self.slot_sent = False  # its SlotSampling went with a launch since its last admission
        self.grammar: Future[Any] | None = None  # the future of its compiled constraint, while it compiles
        self.arrived = time.monotonic()
        self.queued_s: float | None = None  # arrival to first admission (set by KVMemory.match)
        self.matcher: GrammarMatcher | None = None  # its GrammarMatcher once compiled (batonlm.constrained)
        # With prompt logprobs: those of positions prompt_logprob_from + 1.. computed so far
        # (chunks arrive in order), and their top alternatives.
        self.prompt_lp: list[float] = []
        self.prompt_top: list[list[tuple[int, float]]] = []
        self.spec: SpecState | None = None  # its n-gram drafting state (batonlm.scheduler.speculative), once it drafts

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def fill_ids(self) -> list[int]:
        """What an admission extends the KV to: the prompt, and the outputs known so far."""
        return self.prompt_ids + self.output_ids if self.output_ids else self.prompt_ids

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Prompt logprobs are asked and not yet complete (they go out with the first output)."""
        return self.params.prompt_logprobs is not None and not self.output_ids

    @property
    def prompt_logprob_from(self) -> int:
        """The first position whose logits prompt logprobs need (they give the next token's)."""
        return max(self.params.logprob_start_len, 1) - 1

    def prompt_logprob_targets(self, start: int, end: int) -> tuple[int, list[int]]:
        """Of the positions start..end-1 an extend row computes: the first whose logits give a
        wanted prompt logprob, and the prompt tokens those logits are scored on."""
        first = max(start, self.prompt_logprob_from)
        last = min(end, self.prompt_len - 1)  # the last prompt position's logits give an output
        return first, self.prompt_ids[first + 1 : last + 1] if first < last else []

    def cache_key(self, tokens: list[int]) -> list[int]:
        """`tokens` as the prefix cache keys them: an adapter's KV is its own (each token id
        moved into the adapter's range), so two adapters, or an adapter and the base model,
        never share a prefix; requests of the same adapter do. So is LongRoPE's long rotation's."""
        offset = (self.lora_key << 32) + (1 << 62 if self.long_rope else 0)
        return [t + offset for t in tokens] if offset else tokens

    def pool_span(self, start: int, end: int) -> tuple[int, int] | None:
        """Of the positions start..end-1 an extend row computes: those whose hidden states its
        embedding pools (offset from start, count), or None."""
        if self.pooling == "mean":
            return 0, end - start
        if self.pooling == "last" and end == self.prompt_len:
            return end - start - 1, 1
        return None

    def add_pooled(self, values: list[float]) -> None:
        self.pool_sum = values if self.pool_sum is None else [a + b for a, b in zip(self.pool_sum, values, strict=True)]

    @property
    def embedding(self) -> list[float] | None:
        """The pooled hidden states, once every position pooled has been summed."""
        if self.pool_sum is None:
            return None
        if self.pooling == "mean":
            return [v / self.prompt_len for v in self.pool_sum]
        return self.pool_sum

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def admitted(self) -> bool:
        return self.req_slot is not None and self.fill_len > 0

    @property
    def prefilling(self) -> bool:
        """Admitted and not yet extended to its fill length: its next launch is an extend row."""
        return self.admitted and self.kv_len < self.fill_len

    @property
    def can_decode(self) -> bool:
        """Its prefill is launched, it is not known to be finished, and another output is due."""
        return (
            self.finish_reason is None and self.admitted and self.kv_len >= self.fill_len
            and 0 < self.num_outputs_launched < self.max_new_tokens
        )

    @property
    def remaining_new_tokens(self) -> int:
        return self.max_new_tokens - len(self.output_ids)

    def check_finished(self) -> None:
        """Set the finish reason after `output_ids` grew by one token."""
        n = len(self.output_ids)
        last = self.output_ids[-1]
        if last in self.stop_ids and n > self.params.min_new_tokens:
            self.finish_reason = FINISH_STOP
        elif n >= self.max_new_tokens:
            self.finish_reason = FINISH_LENGTH

    def slot_sampling(self) -> SlotSampling:
        """The sampling record the device keeps for this request while it holds its slot; after
        a retraction it carries the outputs so far (penalties count them)."""
        p = self.params
        assert self.req_slot is not None  # sent only while it holds a slot
        return SlotSampling(
            req_slot=self.req_slot,
            params=p,
            seed=self.seed,
            stop_ids=sorted(self.stop_ids),
            prompt_len=self.prompt_len,
            prompt_ids=self.prompt_ids if p.counts_tokens else [],
            output_ids=list(self.output_ids) if p.counts_tokens else [],
        )

    def __repr__(self) -> str:
        return (f"Request({self.rid!r}, prompt={self.prompt_len}, out={len(self.output_ids)}, kv={self.kv_len}/"
                f"{self.fill_len}, finish={self.finish_reason})")
