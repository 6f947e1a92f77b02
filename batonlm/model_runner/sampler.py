"""The sampler: the flow from logits to next tokens, over primitives a backend supplies.

A sampler turns float32 logits into next tokens in four steps: logit bias, repetition,
frequency and presence penalties and min-token suppression (one fused pass); temperature;
top-k / top-p / min-p filtering and seeded sampling; logprobs of the result. The `torch`
sampler runs the plain-torch references (the CPU path); the `triton` one runs the kernels.
Backends are registered in `batonlm.registries.SAMPLERS`; per-row inputs come from the
request-slot table in `sampling_table.py`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from batonlm.kernels import penalties
from batonlm.kernels import sampling as ref
from batonlm.kernels.logprobs import logprobs_reference
from batonlm.kernels.penalties import PenaltyBatch
from batonlm.kernels.sampling import DrawBatch


@dataclass
class SamplingBatch:
    """Per-row sampling inputs of one batch (device tensors). An all-greedy batch has no `draw`:
    gathering temperatures, filters and keys every decode step would be wasted work."""

    banned: torch.Tensor  # [B, S] int64 ids masked to -inf (-1 = padding)
    draw: DrawBatch | None = None  # None: every row is greedy
    penalties: PenaltyBatch | None = None
    bias: tuple[torch.Tensor, torch.Tensor] | None = None  # logit bias alone: ids [B, NB] (-1 = padding), values
    top_logprobs: int = -1  # -1: no logprobs; n >= 0: chosen + n alternatives


@dataclass
class SampleOutput:
    token_ids: torch.Tensor  # [B] int64
    logprobs: torch.Tensor | None = None  # [B] float32
    top_ids: torch.Tensor | None = None  # [B, n] int64
    top_logprobs: torch.Tensor | None = None  # [B, n] float32
    # Prompt logprobs of the launch's scored positions (batonlm.model_runner.prompt_logprobs).
    prompt_logprobs: torch.Tensor | None = None  # [N] float32
    prompt_top_ids: torch.Tensor | None = None  # [N, m] int64
    prompt_top_logprobs: torch.Tensor | None = None  # [N, m] float32
    # Speculative decoding (batonlm.model_runner.spec_verify): drafts accepted per verify group.
    accepted: torch.Tensor | None = None  # [G] int64
    # Embeddings: the summed final hidden states of the launch's pool spans.
    pooled: torch.Tensor | None = None  # [S, H] float32


class Sampler(ABC):
    """The sampling flow; subclasses supply its four primitives (torch references or kernels)."""

    def sample(self, logits: torch.Tensor, batch: SamplingBatch) -> SampleOutput:
        """float32 logits [B, V] -> next token ids (and logprobs when asked)."""
        pen = batch.penalties
        if pen is not None:
            logits = self.penalize(logits, pen, batch.banned)
        else:
            if batch.bias is not None:
                logits = penalties.add_logit_bias(logits, *batch.bias)
            logits = ref.suppress_tokens(logits, batch.banned)
        draw = batch.draw
        ids = self.argmax(logits) if draw is None else self.draw(logits, draw)
        if batch.top_logprobs < 0:
            return SampleOutput(ids)
        # Greedy rows take logprobs at temperature 1 (a temperature of 0 means "greedy").
        temperature = torch.zeros_like(ids, dtype=torch.float32) if draw is None else draw.temperature
        chosen, top_ids, top_lp = self.logprobs(logits, temperature, ids, batch.top_logprobs)
        return SampleOutput(ids, chosen, top_ids, top_lp)

    @abstractmethod
    def penalize(self, logits: torch.Tensor, pen: PenaltyBatch, banned: torch.Tensor) -> torch.Tensor: ...

    @abstractmethod
    def argmax(self, logits: torch.Tensor) -> torch.Tensor: ...

    @abstractmethod
    def draw(self, logits: torch.Tensor, draw: DrawBatch) -> torch.Tensor: ...

    @abstractmethod
    def logprobs(
        self, logits: torch.Tensor, temperature: torch.Tensor, chosen: torch.Tensor, top_n: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...


def triton_sampler_available() -> bool:
    return ref.triton_available()


class TorchSampler(Sampler):
    """The plain-torch reference path (used on the CPU)."""

    def penalize(self, logits: torch.Tensor, pen: PenaltyBatch, banned: torch.Tensor) -> torch.Tensor:
        return penalties.apply_penalties_reference(logits, pen, banned)

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        return logits.argmax(dim=-1)

    def draw(self, logits: torch.Tensor, draw: DrawBatch) -> torch.Tensor:
        return ref.sample_reference(logits, draw)

    def logprobs(self, logits, temperature, chosen, top_n):
        return logprobs_reference(logits, temperature, chosen, top_n)
