"""Verification of speculative drafts on the device.

A verifying request runs as 1 + k consecutive decode rows: its newest output at position p and
its k drafts at p + 1 .. p + k (each row attends to the keys before it, its own included: the
rows' KV is written before attention reads it). Row j samples the token after position p + j
exactly as a plain decode step there would (the request's sampling record, its seed, output
index p + j + 1 - prompt_len). Draft j + 1 is accepted while it equals the token row j sampled,
and the request emits the accepted drafts and the token sampled after them. With deterministic
drafts (q one-hot) this is the rejection sampling of speculative decoding — a draft is accepted
with probability p(draft), a rejected position's token is drawn from p without it — and it
emits exactly the tokens a plain run emits, greedy or seeded.
"""

from __future__ import annotations

import torch


def accept_drafts(tokens: torch.Tensor, inputs: torch.Tensor, groups: list[tuple[int, int]]
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """tokens [N]: each row's sampled token; inputs [N]: each row's input; groups: (first row,
    rows) of each verifying request. Returns (drafts accepted [G], the token after them [G])."""
    device = tokens.device
    width = max(n for _, n in groups)
    offs = torch.arange(width, device=device)
    start = torch.tensor([f for f, _ in groups], device=device)[:, None]
    n = torch.tensor([k for _, k in groups], device=device)[:, None]
    idx = torch.minimum(start + offs[None, :], start + n - 1)  # [G, W], padded with the group's last row
    nxt = torch.minimum(idx + 1, start + n - 1)
    match = (tokens[idx] == inputs[nxt]) & (offs[None, :] < n - 1)
    accepted = match.to(torch.int64).cumprod(dim=1).sum(dim=1)
    bonus = tokens[idx].gather(1, accepted[:, None])[:, 0]
    return accepted, bonus
