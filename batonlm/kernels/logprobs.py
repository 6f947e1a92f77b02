"""Logprobs of sampled tokens and their top alternatives: a torch reference (the CPU path) and
its Triton twin.

logprobs = log_softmax(logits / T) with T = 1 for greedy rows (temperature 0), of the logits
after penalties; alternatives in descending logprob order, a tie going to the lower token id.
"""

from __future__ import annotations

import torch


def _check_top_n(top_n: int, vocab_size: int) -> None:
    if not 0 <= top_n <= vocab_size:
        raise ValueError(f"top_n must be in [0, {vocab_size}], got {top_n}")


def logprobs_reference(
    logits: torch.Tensor, temperature: torch.Tensor, chosen: torch.Tensor, top_n: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(chosen_logprob [B] f32, top_ids [B, top_n] int64, top_logprobs [B, top_n] f32)."""
    _check_top_n(top_n, logits.shape[-1])
    temp = torch.where(temperature > 0, temperature, torch.ones_like(temperature)).to(torch.float32)
    lp = torch.log_softmax(logits.to(torch.float32) / temp[:, None], dim=-1)
    chosen_lp = lp.gather(1, chosen.to(torch.int64)[:, None])[:, 0]
    if top_n == 0:  # nothing to rank (prompt logprobs usually): skip the sort of the vocabulary
        empty = lp.new_empty(lp.shape[0], 0)
        return chosen_lp, empty.to(torch.int64), empty
    # A stable descending sort keeps equal logprobs in id order.
    top_lp, top_ids = lp.sort(dim=-1, descending=True, stable=True)
    return chosen_lp, top_ids[:, :top_n].contiguous(), top_lp[:, :top_n].contiguous()


def logprobs_triton(
    logits: torch.Tensor, temperature: torch.Tensor, chosen: torch.Tensor, top_n: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`logprobs_reference` as one kernel launch (a program per row, no sort of the vocabulary)."""
    _check_top_n(top_n, logits.shape[-1])
    # Imported on first use: see batonlm.kernels.sampling on why.
    from batonlm.kernels import _triton_logprobs

    return _triton_logprobs.logprobs(logits, temperature, chosen, top_n)
