"""Sampling: plain-torch reference functions (the CPU path) and their Triton twins.

Semantics shared with the Triton kernels (which live beside these references):
* greedy rows (temperature 0) take the first maximal logit;
* sampled rows use probabilities p = softmax(logits / temperature) and keep token i iff
  p_i > 0 and p_i >= max(t_k, t_p, t_m), where t_k is the k-th largest probability (top-k),
  t_p the largest t with sum(p_j >= t, j within top-k) >= top_p * (mass within top-k) (top-p
  relative to the top-k-renormalised distribution), t_m = min_p * max(p) (min-p); ties at a
  threshold are all kept;
* the token is drawn by an exponential race, argmax_i p_i / E_i with E_i = -log(u_i), where
  u_i comes from a counter-based hash of (seed, output position, token id): a seeded request
  draws the same token whatever batch it runs in.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class DrawBatch:
    """Per-row inputs of a draw (device tensors, one entry per row)."""

    temperature: torch.Tensor  # [B] float32, 0 = greedy
    top_k: torch.Tensor  # [B] int64, < 1 = off
    top_p: torch.Tensor  # [B] float32
    min_p: torch.Tensor  # [B] float32
    keys: torch.Tensor  # [B] int64 counter keys from (seed, output position): see row_keys


_MASK32 = 0xFFFFFFFF
# Odd constants of the lowbias32 finalizer and of the key schedule.
_M1, _M2 = 0x7FEB352D, 0x846CA68B
_SEED_SALT, _POS_SALT, _TOKEN_SALT = 0x9E3779B9, 0x85EBCA6B, 0xC2B2AE35
_U_SCALE = 1.0 / (1 << 24)
_U_MAX = 1.0 - 1.0 / (1 << 24)


def mix32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 finalizer on uint32 values held in int64 (the low 32 bits of every product)."""
    x = x ^ (x >> 16)
    x = (x * _M1) & _MASK32
    x = x ^ (x >> 15)
    x = (x * _M2) & _MASK32
    return x ^ (x >> 16)


def row_keys(seed_lo: torch.Tensor, seed_hi: torch.Tensor, out_index: torch.Tensor) -> torch.Tensor:
    """32-bit key of each (seed, output position) pair; all inputs int64 in [0, 2**32)."""
    seed_key = mix32(seed_lo ^ mix32((seed_hi + _SEED_SALT) & _MASK32))
    return mix32(seed_key ^ mix32((out_index * _POS_SALT + _POS_SALT) & _MASK32))


def token_salts(vocab_size: int, device: torch.device | str) -> torch.Tensor:
    ids = torch.arange(vocab_size, dtype=torch.int64, device=device)
    return mix32((ids * _TOKEN_SALT + _SEED_SALT) & _MASK32)


def hash_to_uniform(h: torch.Tensor) -> torch.Tensor:
    """float32 uniforms in (0, 1) from uint32 hashes held in int64 (24 bits of each).

    Above 2**23, n + 0.5 is not a float32 and rounds to even: n = 2**24 - 1 would give u = 1,
    E = -log(u) = 0 and an infinite race score that beats every probability, so the largest
    value is clamped to the float below 1."""
    u = ((h >> 8).to(torch.float32) + 0.5) * _U_SCALE
    return u.clamp_(max=_U_MAX)


def counter_uniform(keys: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[B, V] float32 uniforms in (0, 1), a pure function of (row key, token id)."""
    return hash_to_uniform(mix32(keys[:, None] ^ token_salts(vocab_size, keys.device)[None, :]))


def split_seed(seed: int) -> tuple[int, int]:
    """A 64-bit seed (negative values wrap) as (low, high) 32-bit halves."""
    s = seed & 0xFFFFFFFFFFFFFFFF
    return s & _MASK32, s >> 32


def suppress_tokens(logits: torch.Tensor, banned: torch.Tensor) -> torch.Tensor:
    """Set logits[b, banned[b, j]] = -inf for every banned id >= 0 (ids < 0 are padding)."""
    if banned.numel() == 0:
        return logits
    # Padding scatters into an extra column that is then dropped: no boolean indexing, so no
    # device-to-host sync on a GPU.
    v = logits.shape[1]
    padded = torch.cat([logits, logits.new_zeros(logits.shape[0], 1)], dim=1)
    padded.scatter_(1, torch.where(banned >= 0, banned, torch.full_like(banned, v)), float("-inf"))
    return padded[:, :v]


def keep_mask_reference(
    probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> torch.Tensor:
    """[B, V] bool: the tokens top-k, top-p and min-p keep (sort-based reference)."""
    b, v = probs.shape
    ordered = probs.sort(dim=-1, descending=True).values
    k = torch.where(top_k < 1, torch.full_like(top_k, v), top_k.clamp(max=v))
    t_k = ordered.gather(1, (k - 1)[:, None])
    within_k = torch.where(ordered >= t_k, ordered, torch.zeros_like(ordered))
    mass_k = (probs * (probs >= t_k)).sum(-1, keepdim=True)
    csum = within_k.cumsum(-1)
    j = (csum < top_p[:, None] * mass_k).sum(-1, keepdim=True).clamp(max=v - 1)
    t_p = torch.where(top_p[:, None] >= 1.0, torch.zeros_like(t_k), ordered.gather(1, j))
    t_m = min_p[:, None] * ordered[:, :1]
    threshold = torch.maximum(torch.maximum(t_k, t_p), t_m)
    return (probs >= threshold) & (probs > 0)


def kept_probs(logits: torch.Tensor, draw: DrawBatch) -> torch.Tensor:
    """[B, V] float32: the probabilities softmax(logits / temperature) of the tokens top-k, top-p
    and min-p keep, 0 for the rest (not renormalised): the token-keep rule, stated once for the
    sampler and for speculative verification. Greedy rows are at temperature 1 (their token is
    the argmax whatever this says)."""
    is_greedy = draw.temperature <= 0
    temp = torch.where(is_greedy, torch.ones_like(draw.temperature), draw.temperature)
    probs = torch.softmax(logits.float() / temp[:, None], dim=-1)
    keep = keep_mask_reference(probs, draw.top_k, draw.top_p, draw.min_p)
    return torch.where(keep, probs, torch.zeros_like(probs))


def race_draw(probs: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """[B] the exponential race over `probs` (tokens with probability 0 never win): each row's
    token for its counter key, the same whatever batch the row is in."""
    race = -torch.log(counter_uniform(keys, probs.shape[-1]))
    return torch.where(probs > 0, probs / race, torch.full_like(probs, -1.0)).argmax(dim=-1)


def sample_reference(logits: torch.Tensor, draw: DrawBatch) -> torch.Tensor:
    """[B] int64 next tokens for float32 logits [B, V] (see the module docstring)."""
    sampled = race_draw(kept_probs(logits, draw), draw.keys)
    return torch.where(draw.temperature <= 0, logits.argmax(dim=-1), sampled)


def argmax_reference(logits: torch.Tensor) -> torch.Tensor:
    """[B] int64 first maximal index of each row (greedy decoding)."""
    return logits.argmax(dim=-1)


# Triton twins. The kernels live in _triton_sampling, imported on first use: triton is optional
# (macOS has none), and triton.jit decides between compiling and interpreting (TRITON_INTERPRET)
# when a kernel is defined, so defining them at import would fix that choice too early.


def triton_available() -> bool:
    """Whether triton can be imported (the kernels then run on CUDA, or anywhere interpreted)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _kernels():
    from batonlm.kernels import _triton_sampling

    return _triton_sampling


def sample_triton(logits: torch.Tensor, draw: DrawBatch) -> torch.Tensor:
    """`sample_reference` as one kernel launch (a program per row, no sort of the vocabulary).

    The noise is the same integers, so the tokens are the reference's but for float near-ties:
    two race scores within a rounding of each other, or a top-p boundary within the rounding of
    the mass sums (which the two add up in different orders)."""
    return _kernels().sample(logits, draw.temperature, draw.top_k, draw.top_p, draw.min_p, draw.keys)


def keep_mask_triton(
    probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> torch.Tensor:
    """`keep_mask_reference` from the kernel's threshold search (the search `sample_triton` runs)."""
    threshold = _kernels().keep_threshold(probs, top_k, top_p, min_p)
    return (probs >= threshold[:, None]) & (probs > 0)


def argmax_triton(logits: torch.Tensor) -> torch.Tensor:
    """`argmax_reference` as a kernel: first maximal index of each row."""
    return _kernels().argmax(logits)


def counter_uniform_triton(keys: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """`counter_uniform` computed by the kernels' uint32 hash (equal bit for bit)."""
    return _kernels().uniform(keys, vocab_size)
