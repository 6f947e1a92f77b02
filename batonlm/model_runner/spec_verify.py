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

With a draft model the drafts are sampled from its distribution q, and `rejection_verify` is
the standard rejection sampling (accept with min(1, p/q), else draw from max(p - q, 0)): the
emitted tokens follow the target's distribution exactly, and greedy requests still emit the
target's greedy tokens.
"""

from __future__ import annotations

import torch

from batonlm.kernels import sampling as ref
from batonlm.kernels.sampling import DrawBatch


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


# Draft models (q not one-hot): the standard rejection sampling. Keys are the request's counter
# keys (seed, output index) mixed with a salt per use, so every draw is reproducible.
DRAFT_SALT = 0x2545F491  # the draft model's own samples
ACCEPT_SALT = 0x68E31DA4  # the acceptance draws


def salted(keys: torch.Tensor, salt: int) -> torch.Tensor:
    return ref.mix32(keys ^ salt)


# Draws from a distribution (a draft's, a rejection's residual) race as the sampler's draws do.
race = ref.race_draw


def request_probs(logits: torch.Tensor, draw: DrawBatch | None) -> torch.Tensor:
    """[R, V] the distribution a plain step samples from: what the sampler keeps
    (`kept_probs`), renormalised; greedy rows one-hot on the argmax."""
    greedy_ids = logits.argmax(dim=-1)
    one_hot = torch.zeros_like(logits, dtype=torch.float32).scatter_(1, greedy_ids[:, None], 1.0)
    if draw is None:
        return one_hot
    probs = ref.kept_probs(logits, draw)
    probs = probs / probs.sum(dim=-1, keepdim=True)
    return torch.where((draw.temperature <= 0)[:, None], one_hot, probs)


def rejection_verify(p: torch.Tensor, q: torch.Tensor, drafts: torch.Tensor, keys: torch.Tensor
                     ) -> tuple[int, int | None]:
    """One request's k drafts d_1..d_k (drawn from q[0..k-1]) against the target's
    distributions p[0..k] (row j predicts the token after d_j; keys[j] its counter key):
    d_{j+1} is accepted with probability min(1, p_j(d) / q_j(d)); at the first rejection the
    token is drawn from max(p_j - q_j, 0) renormalised. Returns (drafts accepted, the token
    drawn at the rejection; None when all were accepted and the next token is p_k's sample)."""
    k = drafts.shape[0]
    u = ref.hash_to_uniform(salted(keys[:k], ACCEPT_SALT))
    for j in range(k):
        d = int(drafts[j])
        if float(u[j]) * float(q[j, d]) < float(p[j, d]):
            continue
        residual = (p[j] - q[j]).clamp(min=0.0)
        if float(residual.sum()) <= 0.0:  # p == q: any draw is p's
            residual = p[j]
        return j, int(race((residual / residual.sum())[None], keys[j : j + 1])[0])
    return k, None
