"""The Triton sampler: the same flow as the torch sampler, on the kernels (CUDA, or the CPU
under TRITON_INTERPRET=1 for tests)."""

from __future__ import annotations

import torch

from batonlm.model_runner.sampler import PenaltyBatch, Sampler, SamplingBatch, register_sampler


@register_sampler
class TritonSampler(Sampler):
    name = "triton"

    def penalize(self, logits: torch.Tensor, pen: PenaltyBatch, banned: torch.Tensor) -> torch.Tensor:
        from batonlm.kernels.penalties import apply_penalties_triton

        return apply_penalties_triton(
            logits, pen.req_slots, pen.output_counts, pen.prompt_mask, pen.frequency, pen.presence,
            pen.repetition, pen.bias_ids, pen.bias_values, banned,
        )

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        from batonlm.kernels.sampling import argmax_triton

        return argmax_triton(logits)

    def draw(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        from batonlm.kernels.sampling import sample_triton

        return sample_triton(logits, batch.temperature, batch.top_k, batch.top_p, batch.min_p, batch.keys)

    def logprobs(self, logits, temperature, chosen, top_n):
        from batonlm.kernels.logprobs import logprobs_triton

        return logprobs_triton(logits, temperature, chosen, top_n)
