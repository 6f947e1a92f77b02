"""Logit bias, repetition / frequency / presence penalties and banned tokens: a torch reference
(the CPU path) and its Triton twin, one fused pass over the logits.

Row b reads row req_slots[b] of the per-request-slot tables output_counts [num_slots, V] int32
(how often each token was generated) and prompt_mask [num_slots, V] bool (tokens of the prompt).
Per token, in this order:
  (a) logit += logit_bias (bias_ids, -1 = padding; ids are distinct within a row, as in the
      OpenAI dict, and a repeated id adds its values);
  (b) repetition penalty (HF / vLLM) on tokens of the prompt or the output:
      logit > 0 -> logit / rep, else logit * rep (rep = 1 changes nothing);
  (c) OpenAI penalties on output tokens: logit -= frequency * count + presence * (count > 0);
  (d) banned ids (-1 = padding) -> -inf (stop tokens while min_new_tokens is not reached).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from batonlm.kernels.sampling import suppress_tokens


@dataclass
class PenaltyBatch:
    """Penalty inputs of one batch; the count and mask tables are indexed by request slot."""

    req_slots: torch.Tensor  # [B] int64, each row's request slot
    output_counts: torch.Tensor  # [num_slots, V] int32
    prompt_mask: torch.Tensor  # [num_slots, V] bool
    frequency: torch.Tensor  # [B] float32
    presence: torch.Tensor  # [B] float32
    repetition: torch.Tensor  # [B] float32
    bias_ids: torch.Tensor  # [B, NB] int64, -1 = padding
    bias_values: torch.Tensor  # [B, NB] float32


def apply_penalties_reference(logits: torch.Tensor, pen: PenaltyBatch, banned: torch.Tensor) -> torch.Tensor:
    """New float32 [B, V] logits with (a)-(d) of the module docstring applied."""
    logits = logits.to(torch.float32).clone()
    counts = pen.output_counts[pen.req_slots]
    if pen.bias_ids.numel():
        valid = pen.bias_ids >= 0
        rows = torch.arange(logits.shape[0], device=logits.device)[:, None].expand_as(pen.bias_ids)
        logits.index_put_(
            (rows[valid], pen.bias_ids[valid]), pen.bias_values[valid].to(torch.float32), accumulate=True
        )
    seen = pen.prompt_mask[pen.req_slots] | (counts > 0)
    rep = pen.repetition.to(torch.float32)[:, None]
    logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
    freq = pen.frequency.to(torch.float32)[:, None]
    pres = pen.presence.to(torch.float32)[:, None]
    logits = logits - (freq * counts.to(torch.float32) + pres * (counts > 0).to(torch.float32))
    return suppress_tokens(logits, banned)


def add_logit_bias(logits: torch.Tensor, bias_ids: torch.Tensor, bias_values: torch.Tensor) -> torch.Tensor:
    """New float32 logits with (a) alone: the values `apply_penalties_reference` gives rows
    without penalties (one add per id), without its passes over the count tables. Padding (id
    -1) must have the value 0: it adds 0 at id 0 (no boolean indexing, so no device-to-host sync
    on a GPU, and two ops a step)."""
    return logits.to(torch.float32).scatter_add(1, bias_ids.clamp(min=0), bias_values.to(torch.float32))


def apply_penalties_triton(logits: torch.Tensor, pen: PenaltyBatch, banned: torch.Tensor) -> torch.Tensor:
    """`apply_penalties_reference` as one kernel launch (a program per row and vocabulary block);
    returns a new tensor and leaves `logits` as it was."""
    # Imported on first use: see batonlm.kernels.sampling on why.
    from batonlm.kernels import _triton_penalties

    return _triton_penalties.apply(
        logits, pen.req_slots, pen.output_counts, pen.prompt_mask, pen.frequency, pen.presence,
        pen.repetition, pen.bias_ids, pen.bias_values, banned,
    )


def update_output_counts(output_counts: torch.Tensor, req_slots: torch.Tensor, token_ids: torch.Tensor) -> None:
    """Count one sampled token per row into output_counts (in place); negative ids are skipped."""
    # Negative ids add 0 (at id 0) rather than being filtered out: no device-to-host sync.
    valid = token_ids >= 0
    ids = torch.where(valid, token_ids, torch.zeros_like(token_ids))
    output_counts.index_put_((req_slots, ids), valid.to(output_counts.dtype), accumulate=True)


def prompt_mask_row(prompt_ids: Sequence[int] | torch.Tensor, vocab_size: int, device: torch.device | str) -> torch.Tensor:
    """[V] bool row of prompt_mask: True at every token id of the prompt."""
    row = torch.zeros(vocab_size, dtype=torch.bool, device=device)
    ids = torch.as_tensor(prompt_ids, dtype=torch.int64, device=device)
    row[ids] = True
    return row


def reset_slot(
    output_counts: torch.Tensor, prompt_mask: torch.Tensor, slot: int, prompt_ids: Sequence[int] | torch.Tensor
) -> None:
    """Prepare the tables' row of a request slot for a new request (in place)."""
    output_counts[slot] = 0
    prompt_mask[slot] = prompt_mask_row(prompt_ids, prompt_mask.shape[1], prompt_mask.device)
