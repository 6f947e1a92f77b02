"""Request: one generation as the scheduler tracks it."""

from __future__ import annotations

from batonlm.ipc.device_messages import SlotSampling
from batonlm.request_checks import kv_slots_needed
from batonlm.sampling_params import SamplingParams

FINISH_STOP = "stop"
FINISH_LENGTH = "length"
FINISH_ABORT = "abort"


class Request:
    """Prompt, outputs, slots and progress of one request.

    Positions 0..prompt_len-1 hold the prompt; output k (0-based) sits at prompt_len + k. A
    prefill computes the prompt and samples output 0; each decode feeds output k-1 at position
    prompt_len + k - 1 and samples output k. `num_launched` counts outputs whose forward has
    been launched; `output_ids` holds those whose result has been processed (the two differ by
    the forwards in flight).
    """

    __slots__ = (
        "rid",
        "prompt_ids",
        "params",
        "seed",
        "max_new_tokens",
        "kv_needed",
        "stop_ids",
        "output_ids",
        "req_slot",
        "kv_slots",
        "num_launched",
        "inflight",
        "finish_reason",
    )

    def __init__(
        self, rid: str, prompt_ids: list[int], params: SamplingParams, seed: int, context_length: int,
        eos_ids: tuple[int, ...],
    ) -> None:
        self.rid = rid
        self.prompt_ids = prompt_ids
        self.params = params
        self.seed = seed
        # The last output may sit at position context_length - 1 at most.
        self.kv_needed, self.max_new_tokens = kv_slots_needed(len(prompt_ids), params.max_new_tokens, context_length)
        stops = set(params.stop_token_ids)
        if not params.ignore_eos:
            stops.update(eos_ids)
        self.stop_ids = frozenset(stops)
        self.output_ids: list[int] = []
        self.req_slot: int | None = None
        # The KV slot of every position the request may fill, allocated at admission.
        self.kv_slots: list[int] = []
        self.num_launched = 0
        self.inflight = 0
        self.finish_reason: str | None = None

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def kv_len(self) -> int:
        """Positions whose KV a launched forward computes: the prompt, then one per decode."""
        return self.prompt_len + self.num_launched - 1 if self.num_launched else 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def can_decode(self) -> bool:
        """Started, not known to be finished, and another forward is still needed."""
        return self.finish_reason is None and 0 < self.num_launched < self.max_new_tokens

    def check_finished(self) -> None:
        """Set the finish reason after `output_ids` grew by one token."""
        n = len(self.output_ids)
        last = self.output_ids[-1]
        if last in self.stop_ids and n > self.params.min_new_tokens:
            self.finish_reason = FINISH_STOP
        elif n >= self.max_new_tokens:
            self.finish_reason = FINISH_LENGTH

    def slot_sampling(self) -> SlotSampling:
        """The sampling record the device keeps for this request while it holds its slot."""
        p = self.params
        return SlotSampling(
            req_slot=self.req_slot,  # type: ignore[arg-type]
            params=p,
            seed=self.seed,
            stop_ids=sorted(self.stop_ids),
            prompt_len=self.prompt_len,
            prompt_ids=self.prompt_ids if p.has_penalties else [],
        )

    def __repr__(self) -> str:
        return f"Request({self.rid!r}, prompt={self.prompt_len}, out={len(self.output_ids)}, finish={self.finish_reason})"
