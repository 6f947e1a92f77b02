"""Building blocks of the decoder: RMSNorm, rotary embedding, gated MLP.

Each follows the Hugging Face implementation operation for operation (fp32 statistics in
RMSNorm, fp32 rotary tables) so that greedy outputs match transformers token for token.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from batonlm.distributed.group import TPGroup
from batonlm.kernels.moe import ACTIVATIONS
from batonlm.model_runner.linear import Linear
from batonlm.model_runner.parallel_layers import RowParallelLinear
from batonlm.model_runner.rope_config import RopeConfig, yarn_mscale


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


class OffsetRMSNorm(RMSNorm):
    """Gemma's RMSNorm: the weight stored as an offset from 1, applied in float32 before the
    result is rounded back (transformers' order of operations)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.to(torch.float32))).to(x.dtype)


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """Inverse frequencies, with the `linear`, `llama3` and `yarn` scalings as transformers
    computes them."""
    if rope.type == "yarn":
        return _yarn_inv_freq(rope, head_dim)
    if rope.type == "longrope":  # the short factors; `RotaryEmbedding` switches to the long ones
        return _longrope_inv_freq(rope, head_dim, rope.short_factor)
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope.type == "linear":
        return inv_freq / rope.factor
    if rope.type == "llama3":
        old_ctx = rope.original_max_position_embeddings
        low_wavelen = old_ctx / rope.low_freq_factor
        high_wavelen = old_ctx / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (old_ctx / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    return inv_freq


def _yarn_inv_freq(rope: RopeConfig, dim: int) -> torch.Tensor:
    """YaRN: frequencies that turn fewer than `beta_slow` times over the original context are
    interpolated (divided by `factor`), those turning more than `beta_fast` times kept, a linear
    ramp between."""

    def correction_dim(rotations: float) -> float:
        return dim * math.log(rope.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = rope.theta ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1 - ramp
    return (1.0 / (rope.factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def _longrope_inv_freq(rope: RopeConfig, dim: int, factors: tuple[float, ...]) -> torch.Tensor:
    if len(factors) != dim // 2:
        raise ValueError(f"longrope has {len(factors)} factors for a rotary of {dim} features (needs {dim // 2})")
    shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return 1.0 / (torch.tensor(factors, dtype=torch.float32) * rope.theta**shape)


def rope_attention_factor(rope: RopeConfig) -> float:
    """What cos and sin are multiplied by: YaRN's and LongRoPE's temperature, else 1."""
    if rope.type not in ("yarn", "longrope"):
        return 1.0
    if rope.attention_factor is not None:
        return rope.attention_factor
    if rope.type == "longrope":
        if rope.factor <= 1.0:
            return 1.0
        return math.sqrt(1 + math.log(rope.factor) / math.log(rope.original_max_position_embeddings))
    if rope.mscale and rope.mscale_all_dim:
        return float(yarn_mscale(rope.factor, rope.mscale) / yarn_mscale(rope.factor, rope.mscale_all_dim))
    return yarn_mscale(rope.factor)


class RotaryEmbedding(nn.Module):
    """Rotate-half RoPE with a precomputed cos/sin table indexed by position.

    LongRoPE has two tables: rows [0, max_positions) by the short factors, rows [max_positions,
    2 * max_positions) by the long ones, which a sequence longer than the original context reads
    at every position (`ForwardBatch.rope_positions`: the scheduler keeps the two apart,
    planner.PlannerConfig.long_rope_from)."""

    cos: torch.Tensor  # buffers: [max_positions, head_dim]
    sin: torch.Tensor

    def __init__(self, rope: RopeConfig, head_dim: int, max_positions: int, meta: bool = False) -> None:
        """`meta`: shapes only (the model is being built on the meta device, where computing the
        tables would cost seconds of torch's Python reference ops; `init_buffers` computes them)."""
        super().__init__()
        if meta:
            rows = 2 * max_positions if rope.type == "longrope" else max_positions
            cos = sin = torch.empty(rows, head_dim, device="meta")
        else:
            inv_freq = rope_inv_freq(rope, head_dim)
            pos = torch.arange(max_positions, dtype=torch.float32)
            freqs = pos[:, None] * inv_freq[None, :]
            if rope.type == "longrope":
                freqs = torch.cat((freqs, pos[:, None] * _longrope_inv_freq(rope, head_dim, rope.long_factor)[None, :]))
            emb = torch.cat((freqs, freqs), dim=-1)
            cos, sin = emb.cos(), emb.sin()
            factor = rope_attention_factor(rope)
            if factor != 1.0:
                cos, sin = cos * factor, sin * factor
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape [T, 1, head_dim] for the given positions, in the model dtype."""
        return self.cos[positions].to(dtype)[:, None, :], self.sin[positions].to(dtype)[:, None, :]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim]; a table narrower than the head rotates its leading features
    (partial rotary) and passes the rest."""
    rotary = cos.shape[-1]
    if rotary < x.shape[-1]:
        return torch.cat((apply_rope(x[..., :rotary], cos, sin), x[..., rotary:]), dim=-1)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def activation(name: str):
    """`hidden_act`'s function, from the one registry (kernels/moe.py: the MoE op names its
    activation by it)."""
    try:
        return ACTIVATIONS[name]
    except KeyError:
        raise ValueError(f"hidden_act {name!r} is not supported (supported: {sorted(ACTIVATIONS)})") from None


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)) with gate and up fused into one matmul. Under tensor
    parallelism `intermediate` is this rank's share and down_proj sums over the ranks."""

    def __init__(
        self, hidden: int, intermediate: int, act: str, bias: bool = False, tp: TPGroup | None = None,
        checkpoint_rows: tuple[int, int] | None = None,
    ) -> None:
        """`checkpoint_rows`: (first feature, the checkpoint's feature count) of this slice, which
        the weight loader reads (None: all of them, unsplit)."""
        super().__init__()
        self.checkpoint_rows = checkpoint_rows or (0, intermediate)
        self.gate_up_proj = Linear(hidden, 2 * intermediate, bias=bias)
        self.down_proj = RowParallelLinear(intermediate, hidden, bias, tp or TPGroup.single())
        self.intermediate = intermediate
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        return self.down_proj(self.act(gate) * up)
