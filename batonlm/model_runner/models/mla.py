"""Multi-head latent attention (DeepSeek-V2/V3), attending over the latents the KV pool stores.

Every head's key and value are projections of one per-token latent `c` (`kv_lora_rank`
features after `kv_a_layernorm`) by `kv_b_proj`, plus a rotary key `k_pe` shared by the heads:

    k_h = [W_UK_h c, k_pe],   v_h = W_UV_h c   (W_UK_h, W_UV_h: head h's rows of kv_b_proj)

So the pool stores `[c, k_pe]` per token and layer (`ModelConfig.kv_head_dim` = kv_lora_rank +
qk_rope_head_dim, one "KV head"), not H heads of K and V, and attention runs over it with the
projections absorbed into the query and the output:

    q_h . k_h = [W_UK_h^T q_nope_h, q_pe_h] . [c, k_pe]
    out_h     = W_UV_h (sum_j p_j c_j)

that is multi-query attention of H query heads over one head of dim kv_lora_rank +
qk_rope_head_dim, with the softmax scale of the unabsorbed head dim (`ModelConfig.
attention_scale`). The values are the latent: the pool's keys are passed as the values too
(`KVPool(latent=True)` stores them once), and of each head's output the latent's features are
kept, the rotary part's weighted sum dropped (its 1/9 extra work in the P.V product is what lets
every attention backend, the compiled step and the Triton kernels run MLA unchanged).

Under tensor parallelism each rank holds its query heads (rows of q_proj / q_b_proj and of
kv_b_proj, columns of o_proj); the latent projections are replicated and every rank stores the
whole latent.
"""

from __future__ import annotations

import torch
from torch import nn

from batonlm.distributed.group import TPGroup
from batonlm.distributed.layout import TPLayout
from batonlm.model_runner.attention.base import AttentionBackend
from batonlm.model_runner.forward_batch import ForwardBatch
from batonlm.model_runner.layers import RMSNorm, apply_rope
from batonlm.model_runner.linear import Linear
from batonlm.model_runner.model_config import ModelConfig
from batonlm.model_runner.parallel_layers import RowParallelLinear

# transformers' DeepSeek norms inside attention keep RMSNorm's default epsilon.
_LATENT_NORM_EPS = 1e-6


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """Rotary features stored as pairs (x0, x1), (x2, x3), ... -> (x0, x2, ..., x1, x3, ...):
    rotate-half RoPE over the result is DeepSeek's pairwise rotation, features permuted alike in
    queries and keys (their dot products unchanged)."""
    return x.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)


class ProjectionWeight(nn.Module):
    """A projection's weight that is read, never applied as a layer: not a linear layer, so not
    packed for oneDNN nor kept quantized (a quantized checkpoint's is dequantized on load)."""

    def __init__(self, out_features: int, in_features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))


class MLAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, shard: TPLayout, tp: TPGroup, bias: bool) -> None:
        super().__init__()
        mla = cfg.mla
        assert mla is not None, "MLAttention needs the config's MLA fields"
        self.mla = mla
        self.layer = layer
        self.heads = shard.heads
        q_out = self.heads * mla.qk_head_dim
        self.q_proj = self.q_a_proj = self.q_a_layernorm = self.q_b_proj = None
        if mla.q_lora_rank is None:
            self.q_proj = Linear(cfg.hidden_size, q_out, bias=False)
        else:
            self.q_a_proj = Linear(cfg.hidden_size, mla.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, _LATENT_NORM_EPS)
            self.q_b_proj = Linear(mla.q_lora_rank, q_out, bias=False)
        self.kv_a_proj_with_mqa = Linear(cfg.hidden_size, mla.latent_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, _LATENT_NORM_EPS)
        self.kv_b_proj = ProjectionWeight(self.heads * (mla.qk_nope_head_dim + mla.v_head_dim), mla.kv_lora_rank)
        self.o_proj = RowParallelLinear(self.heads * mla.v_head_dim, cfg.hidden_size, bias, tp)

    def absorbed(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_UK [H, nope, rank], W_UV^T [H, rank, v]): views of kv_b_proj's weight."""
        mla = self.mla
        w = self.kv_b_proj.weight.view(self.heads, mla.qk_nope_head_dim + mla.v_head_dim, mla.kv_lora_rank)
        return w[:, : mla.qk_nope_head_dim], w[:, mla.qk_nope_head_dim :].transpose(1, 2)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionBackend, batch: ForwardBatch
    ) -> torch.Tensor:
        mla, t, h = self.mla, x.shape[0], self.heads
        if self.q_proj is not None:
            q = self.q_proj(x)
        else:
            assert self.q_a_proj is not None and self.q_a_layernorm is not None and self.q_b_proj is not None
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_pe = q.view(t, h, mla.qk_head_dim).split((mla.qk_nope_head_dim, mla.qk_rope_head_dim), dim=-1)
        latent, k_pe = self.kv_a_proj_with_mqa(x).split((mla.kv_lora_rank, mla.qk_rope_head_dim), dim=-1)
        latent = self.kv_a_layernorm(latent)
        k_pe = k_pe[:, None, :]
        if mla.rope_interleave:
            q_pe, k_pe = deinterleave(q_pe), deinterleave(k_pe)
        q_pe, k_pe = apply_rope(q_pe, cos, sin), apply_rope(k_pe, cos, sin)
        w_uk, w_uv = self.absorbed()
        q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [T, H, rank]
        keys = torch.cat((latent[:, None, :], k_pe), dim=-1)  # [T, 1, rank + rope]: what the pool stores
        out = attn.forward(torch.cat((q_latent, q_pe), dim=-1), keys, keys, self.layer, batch)
        out_latent = out.view(t, h, mla.latent_dim)[..., : mla.kv_lora_rank]
        heads = torch.bmm(out_latent.transpose(0, 1), w_uv)  # [H, T, v]
        return self.o_proj(heads.transpose(0, 1).reshape(t, h * mla.v_head_dim))
