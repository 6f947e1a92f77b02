"""The sampler interface, its registry, and the per-request-slot sampling table.

A sampler turns float32 logits into next tokens in four steps: logit bias, repetition,
frequency and presence penalties and min-token suppression (one fused pass); temperature;
top-k / top-p / min-p filtering and seeded sampling; logprobs of the result. The `torch`
sampler runs the plain-torch references (the CPU path); the `triton` one runs the kernels.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch

from batonlm.kernels import penalties
from batonlm.kernels import sampling as ref
from batonlm.model_runner.host_to_device import to_device


@dataclass
class PenaltyBatch:
    """Penalty inputs of one batch; the count/mask tables are indexed by request slot."""

    req_slots: torch.Tensor  # [B]
    output_counts: torch.Tensor  # [num_slots, V] int32
    prompt_mask: torch.Tensor  # [num_slots, V] bool
    frequency: torch.Tensor  # [B] float32
    presence: torch.Tensor  # [B] float32
    repetition: torch.Tensor  # [B] float32
    bias_ids: torch.Tensor  # [B, NB] int64, -1 = padding
    bias_values: torch.Tensor  # [B, NB] float32


@dataclass
class SamplingBatch:
    """Per-row sampling inputs of one batch (device tensors). An all-greedy batch leaves the draw
    inputs (`top_k`, `top_p`, `min_p`, `keys`) unset, and `temperature` too unless it wants
    logprobs: gathering them every decode step would be wasted work."""

    banned: torch.Tensor  # [B, S] int64 ids masked to -inf (-1 = padding)
    all_greedy: bool
    temperature: torch.Tensor | None = None  # [B] float32, 0 = greedy
    top_k: torch.Tensor | None = None  # [B] int64, -1 = off
    top_p: torch.Tensor | None = None  # [B] float32
    min_p: torch.Tensor | None = None  # [B] float32
    keys: torch.Tensor | None = None  # [B] int64 counter keys from (seed, output position)
    penalties: PenaltyBatch | None = None
    top_logprobs: int = -1  # -1: no logprobs; n >= 0: chosen + n alternatives


@dataclass
class SampleOutput:
    token_ids: torch.Tensor  # [B] int64
    logprobs: torch.Tensor | None = None  # [B] float32
    top_ids: torch.Tensor | None = None  # [B, n] int64
    top_logprobs: torch.Tensor | None = None  # [B, n] float32


class Sampler(ABC):
    """The sampling flow; subclasses supply its four primitives (torch references or kernels)."""

    name: ClassVar[str]

    def sample(self, logits: torch.Tensor, batch: SamplingBatch) -> SampleOutput:
        """float32 logits [B, V] -> next token ids (and logprobs when asked)."""
        pen = batch.penalties
        if pen is not None:
            logits = self.penalize(logits, pen, batch.banned)
        else:
            logits = ref.suppress_tokens(logits, batch.banned)
        if batch.all_greedy:
            ids = self.argmax(logits)
        else:
            ids = self.draw(logits, batch)
        if batch.top_logprobs < 0:
            return SampleOutput(ids)
        chosen, top_ids, top_lp = self.logprobs(logits, batch.temperature, ids, batch.top_logprobs)
        return SampleOutput(ids, chosen, top_ids, top_lp)

    @abstractmethod
    def penalize(self, logits: torch.Tensor, pen: PenaltyBatch, banned: torch.Tensor) -> torch.Tensor: ...

    @abstractmethod
    def argmax(self, logits: torch.Tensor) -> torch.Tensor: ...

    @abstractmethod
    def draw(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor: ...

    @abstractmethod
    def logprobs(
        self, logits: torch.Tensor, temperature: torch.Tensor, chosen: torch.Tensor, top_n: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...


SAMPLERS: dict[str, type[Sampler]] = {}


def register_sampler(cls: type[Sampler]) -> type[Sampler]:
    SAMPLERS[cls.name] = cls
    return cls


def sampler_names() -> list[str]:
    # The Triton sampler registers itself on import (triton itself is imported on first use).
    from batonlm.model_runner import triton_sampler  # noqa: F401

    return sorted(SAMPLERS)


def triton_sampler_available() -> bool:
    return ref.triton_available()


def get_sampler(name: str) -> Sampler:
    sampler_names()
    try:
        return SAMPLERS[name]()
    except KeyError:
        raise ValueError(f"sampler {name!r} is not known (known: {sorted(SAMPLERS)})") from None


@register_sampler
class TorchSampler(Sampler):
    """The plain-torch reference path (used on the CPU)."""

    name = "torch"

    def penalize(self, logits: torch.Tensor, pen: PenaltyBatch, banned: torch.Tensor) -> torch.Tensor:
        return penalties.apply_penalties_reference(
            logits, pen.req_slots, pen.output_counts, pen.prompt_mask, pen.frequency, pen.presence,
            pen.repetition, pen.bias_ids, pen.bias_values, banned,
        )

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        return logits.argmax(dim=-1)

    def draw(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        return ref.sample_reference(logits, batch.temperature, batch.top_k, batch.top_p, batch.min_p, batch.keys)

    def logprobs(self, logits, temperature, chosen, top_n):
        from batonlm.kernels.logprobs import logprobs_reference

        return logprobs_reference(logits, temperature, chosen, top_n)


class SlotSamplingTable:
    """Sampling parameters and penalty state of each request slot, written once when a request
    starts, so that a launch only names slots and positions."""

    def __init__(self, num_slots: int, vocab_size: int, device: torch.device | str) -> None:
        def z(dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(num_slots, dtype=dtype, device=device)

        self.num_slots = num_slots
        self.vocab_size = vocab_size
        self.device = device
        self.temperature = z(torch.float32)
        self.top_k = z(torch.int64)
        self.top_p = z(torch.float32)
        self.min_p = z(torch.float32)
        self.seed_lo = z(torch.int64)
        self.seed_hi = z(torch.int64)
        self.prompt_len = z(torch.int64)
        self.min_new_tokens = z(torch.int64)
        self.frequency = z(torch.float32)
        self.presence = z(torch.float32)
        self.repetition = torch.ones(num_slots, dtype=torch.float32, device=device)
        self.stop_ids = self._ids_table(0)
        self.bias_ids = self._ids_table(0)
        self.bias_values = torch.zeros((num_slots, 0), dtype=torch.float32, device=device)
        # [num_slots, V] tables, allocated when the first request with penalties arrives.
        self.output_counts: torch.Tensor | None = None
        self.prompt_mask: torch.Tensor | None = None
        self._penalized = [False] * num_slots
        self._num_penalized = 0

    def _ids_table(self, width: int) -> torch.Tensor:
        return torch.full((self.num_slots, width), -1, dtype=torch.int64, device=self.device)

    def _widen(self, table: torch.Tensor, width: int, fill: float) -> torch.Tensor:
        if width <= table.shape[1]:
            return table
        grown = torch.full((self.num_slots, width), fill, dtype=table.dtype, device=self.device)
        grown[:, : table.shape[1]] = table
        return grown

    def init_slot(
        self,
        slot: int,
        *,
        prompt_ids: list[int],
        temperature: float,
        top_k: int,
        top_p: float,
        min_p: float,
        seed: int,
        min_new_tokens: int,
        stop_ids: list[int],
        frequency_penalty: float = 0.0,
        presence_penalty: float = 0.0,
        repetition_penalty: float = 1.0,
        logit_bias: dict[int, float] | None = None,
    ) -> None:
        lo, hi = ref.split_seed(seed)
        self.temperature[slot] = temperature
        self.top_k[slot] = top_k
        self.top_p[slot] = top_p
        self.min_p[slot] = min_p
        self.seed_lo[slot] = lo
        self.seed_hi[slot] = hi
        self.prompt_len[slot] = len(prompt_ids)
        self.min_new_tokens[slot] = min_new_tokens
        self.frequency[slot] = frequency_penalty
        self.presence[slot] = presence_penalty
        self.repetition[slot] = repetition_penalty
        device = torch.device(self.device)
        self.stop_ids = self._widen(self.stop_ids, len(stop_ids), -1)
        self.stop_ids[slot] = -1
        if stop_ids:
            self.stop_ids[slot, : len(stop_ids)] = to_device(stop_ids, torch.int64, device)
        bias = logit_bias or {}
        self.bias_ids = self._widen(self.bias_ids, len(bias), -1)
        self.bias_values = self._widen(self.bias_values, len(bias), 0.0)
        self.bias_ids[slot] = -1
        self.bias_values[slot] = 0.0
        if bias:
            self.bias_ids[slot, : len(bias)] = to_device(list(bias), torch.int64, device)
            self.bias_values[slot, : len(bias)] = to_device(list(bias.values()), torch.float32, device)
        penalized = bool(bias) or frequency_penalty != 0.0 or presence_penalty != 0.0 or repetition_penalty != 1.0
        self._num_penalized += int(penalized) - int(self._penalized[slot])
        self._penalized[slot] = penalized
        if penalized:
            if self.output_counts is None:
                shape = (self.num_slots, self.vocab_size)
                self.output_counts = torch.zeros(shape, dtype=torch.int32, device=self.device)
                self.prompt_mask = torch.zeros(shape, dtype=torch.bool, device=self.device)
            penalties.reset_slot(self.output_counts, self.prompt_mask, slot, to_device(prompt_ids, torch.int64, device))

    def record_outputs(self, req_slots: torch.Tensor, token_ids: torch.Tensor) -> None:
        """Count the sampled tokens (frequency/presence/repetition penalties read the counts)."""
        if self.output_counts is not None and self._num_penalized:
            penalties.update_output_counts(self.output_counts, req_slots, token_ids)

    def gather(
        self, req_slots: torch.Tensor, seq_lens: torch.Tensor, all_greedy: bool, top_logprobs: int = -1
    ) -> SamplingBatch:
        banned = self.stop_ids[req_slots]
        if banned.shape[1] or not all_greedy:
            out_index = seq_lens - self.prompt_len[req_slots]  # the output position being sampled
        if banned.shape[1]:
            under_min = out_index < self.min_new_tokens[req_slots]
            banned = torch.where(under_min[:, None], banned, torch.full_like(banned, -1))
        penalties = None
        if self._num_penalized:
            assert self.output_counts is not None and self.prompt_mask is not None
            penalties = PenaltyBatch(
                req_slots=req_slots,
                output_counts=self.output_counts,
                prompt_mask=self.prompt_mask,
                frequency=self.frequency[req_slots],
                presence=self.presence[req_slots],
                repetition=self.repetition[req_slots],
                bias_ids=self.bias_ids[req_slots],
                bias_values=self.bias_values[req_slots],
            )
        batch = SamplingBatch(banned=banned, all_greedy=all_greedy, penalties=penalties, top_logprobs=top_logprobs)
        if not all_greedy or top_logprobs >= 0:
            batch.temperature = self.temperature[req_slots]
        if not all_greedy:
            batch.top_k = self.top_k[req_slots]
            batch.top_p = self.top_p[req_slots]
            batch.min_p = self.min_p[req_slots]
            batch.keys = ref.row_keys(self.seed_lo[req_slots], self.seed_hi[req_slots], out_index)
        return batch
