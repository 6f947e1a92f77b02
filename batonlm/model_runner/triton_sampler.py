"""The Triton sampler: the same flow as the torch sampler, on the kernels (CUDA, or the CPU
under TRITON_INTERPRET=1 for tests). Kernels are imported on first use: see kernels/sampling.py."""

from __future__ import annotations

import torch

from batonlm.kernels.penalties import PenaltyBatch
from batonlm.kernels.sampling import DrawBatch
from batonlm.model_runner.sampler import Sampler


class TritonSampler(Sampler):
    def penalize(self, logits: torch.Tensor, pen: PenaltyBatch, banned: torch.Tensor) -> torch.Tensor:
        from batonlm.kernels.penalties import apply_penalties_triton

        return apply_penalties_triton(logits, pen, banned)

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        from batonlm.kernels.sampling import argmax_triton

        return argmax_triton(logits)

    def draw(self, logits: torch.Tensor, draw: DrawBatch) -> torch.Tensor:
        from batonlm.kernels.sampling import sample_triton

        return sample_triton(logits, draw)

    def logprobs(self, logits, temperature, chosen, top_n):
        from batonlm.kernels.logprobs import logprobs_triton

        return logprobs_triton(logits, temperature, chosen, top_n)
