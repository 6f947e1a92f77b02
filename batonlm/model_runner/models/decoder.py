"""One decoder for the Llama family (Llama 2/3, Mistral, Qwen2, Qwen3), options per family.

Module names mirror Hugging Face's except where projections are fused (`qkv_proj`,
`gate_up_proj`); `stacked_params` tells the loader which checkpoint tensors fill which slice.
"""

from __future__ import annotations

import torch
from torch import nn

from batonlm.model_runner.attention.base import AttentionBackend
from batonlm.model_runner.forward_batch import ForwardBatch
from batonlm.model_runner.layers import GatedMLP, RMSNorm, RotaryEmbedding, apply_rope
from batonlm.model_runner.model_config import ModelConfig
from batonlm.model_runner.models.families import DecoderOptions


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, opts: DecoderOptions, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.heads, self.kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = self.heads * self.head_dim
        self.kv_size = self.kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=opts.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=opts.o_bias)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if opts.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if opts.qk_norm else None

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn: AttentionBackend,
        batch: ForwardBatch,
    ) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        qk_size = self.q_size + self.kv_size
        v = qkv[:, qk_size:].view(-1, self.kv_heads, self.head_dim)
        if self.q_norm is None:
            # One rotary pass over the query and key heads together: fewer ops per layer.
            qk = apply_rope(qkv[:, :qk_size].view(-1, self.heads + self.kv_heads, self.head_dim), cos, sin)
            q, k = qk.split((self.heads, self.kv_heads), dim=1)
        else:
            q = self.q_norm(qkv[:, : self.q_size].view(-1, self.heads, self.head_dim))
            k = self.k_norm(qkv[:, self.q_size : qk_size].view(-1, self.kv_heads, self.head_dim))
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        return self.o_proj(attn.forward(q, k, v, self.layer, batch))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, opts: DecoderOptions, layer: int) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, opts, layer)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act, bias=opts.mlp_bias)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, attn: AttentionBackend, batch: ForwardBatch) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attn, batch)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderBody(nn.Module):
    def __init__(self, cfg: ModelConfig, opts: DecoderOptions) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, opts, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class DecoderLM(nn.Module):
    """Causal LM: `forward` returns the final hidden states of every token; `logits` projects
    the selected rows to float32 vocabulary logits."""

    # (fused parameter, checkpoint name, shard index in the fused parameter's first dimension)
    stacked_params: tuple[tuple[str, str, int], ...] = (
        ("qkv_proj", "q_proj", 0),
        ("qkv_proj", "k_proj", 1),
        ("qkv_proj", "v_proj", 2),
        ("gate_up_proj", "gate_proj", 0),
        ("gate_up_proj", "up_proj", 1),
    )

    def __init__(self, cfg: ModelConfig, opts: DecoderOptions) -> None:
        super().__init__()
        self.config = cfg
        self.model = DecoderBody(cfg, opts)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(cfg.rope, cfg.head_dim, cfg.max_position_embeddings)

    def shard_sizes(self, fused: str) -> tuple[int, ...]:
        cfg = self.config
        if fused == "qkv_proj":
            return (cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim)
        if fused == "gate_up_proj":
            return (cfg.intermediate_size, cfg.intermediate_size)
        raise KeyError(fused)

    def forward(self, input_ids: torch.Tensor, batch: ForwardBatch, attn: AttentionBackend) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.rotary.tables(batch.positions, x.dtype)
        for layer in self.model.layers:
            x = layer(x, cos, sin, attn, batch)
        return x

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        hidden = self.model.norm(hidden)
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return torch.nn.functional.linear(hidden, weight).float()
