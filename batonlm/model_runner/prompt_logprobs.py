"""Prompt logprobs: how likely the model found each prompt token, from the hidden state of the
position before it, under the raw model distribution (log_softmax of the logits, temperature 1,
no penalties), with the most likely alternatives.

Positions are scored a block at a time: a full-vocabulary row of logits exists only while its
block is scored (`LOGITS_BLOCK_BYTES` of logits at most), whatever the prompt's length.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from batonlm.model_runner.sampler import Sampler

LOGITS_BLOCK_BYTES = 16 << 20


def block_rows(vocab_size: int) -> int:
    """How many positions one block scores."""
    return max(1, LOGITS_BLOCK_BYTES // (4 * vocab_size))


def score_tokens(
    logits_of: Callable[[torch.Tensor], torch.Tensor],
    sampler: Sampler,
    hidden: torch.Tensor,
    targets: torch.Tensor,
    top_n: int,
    vocab_size: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """hidden [N, H] (of the positions before the scored tokens), targets [N] -> (logprob [N]
    float32, top ids [N, top_n] int64, top logprobs [N, top_n] float32)."""
    n = hidden.shape[0]
    chosen = torch.empty(n, dtype=torch.float32, device=hidden.device)
    top_ids = torch.empty(n, top_n, dtype=torch.int64, device=hidden.device)
    top_lp = torch.empty(n, top_n, dtype=torch.float32, device=hidden.device)
    step = block_rows(vocab_size)
    for i in range(0, n, step):
        logits = logits_of(hidden[i : i + step])
        temperature = torch.zeros(logits.shape[0], dtype=torch.float32, device=logits.device)  # 0: raw
        c, ti, tl = sampler.logprobs(logits, temperature, targets[i : i + step], top_n)
        chosen[i : i + step], top_ids[i : i + step], top_lp[i : i + step] = c, ti, tl
    return chosen, top_ids, top_lp
