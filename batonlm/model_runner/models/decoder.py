"""One decoder for the Llama-like families (Llama 2/3, Mistral, Qwen2, Qwen3, and with sparse
MoE layers in place of MLPs Qwen2-MoE, Qwen3-MoE and Mixtral; with offset and sandwich norms,
scaled embeddings and soft-capping Gemma 2/3; with multi-head latent attention DeepSeek-V2/V3,
`mla.py`): what they differ in is a `DecoderOptions`, which each family's
subclass (`families.py`, `deepseek.py`) reads from its config.

Module names mirror Hugging Face's except where projections are fused (`qkv_proj`, whose
slices `stacked_params` names for the loader; `gate_up_proj`, whose `GatedMLP` says its rows).
Under tensor parallelism every size is this rank's share (`TPLayout`): its heads, its KV heads,
its intermediate features, its vocabulary rows; o_proj, down_proj and the embedding sum over
the ranks, the LM head gathers their logits.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from batonlm.distributed.group import TPGroup
from batonlm.distributed.layout import TPLayout
from batonlm.model_runner.attention.base import AttentionBackend
from batonlm.model_runner.forward_batch import ForwardBatch
from batonlm.model_runner.layers import GatedMLP, OffsetRMSNorm, RMSNorm, RotaryEmbedding, apply_rope
from batonlm.model_runner.linear import Linear
from batonlm.model_runner.model_config import ModelConfig
from batonlm.model_runner.models.base import CausalLM
from batonlm.model_runner.models.mla import MLAttention
from batonlm.model_runner.moe import MoEOptions, SparseMoE
from batonlm.model_runner.parallel_layers import (
    RowParallelLinear,
    VocabParallelEmbedding,
    dp_gathered_mlp,
    vocab_logits,
)


@dataclass(frozen=True)
class DecoderOptions:
    """What a Llama-like family changes in the decoder."""

    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # an RMSNorm over each query and key head, before the rotary
    # Gemma: norms whose weight is an offset from 1 (layers.OffsetRMSNorm); norms around the
    # attention output and the MLP besides the pre-norms; embeddings times sqrt(hidden); the
    # final logits soft-capped (cap * tanh(logits / cap); None: not).
    offset_norms: bool = False
    sandwich_norms: bool = False
    scale_embeddings: bool = False
    final_softcap: float | None = None
    moe: MoEOptions | None = None  # the experts of the layers in `moe_layers` (moe.py)
    moe_layers: frozenset[int] = field(default_factory=frozenset)

    @property
    def norm(self) -> type[RMSNorm]:
        return OffsetRMSNorm if self.offset_norms else RMSNorm


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, opts: DecoderOptions, layer: int, shard: TPLayout, tp: TPGroup) -> None:
        super().__init__()
        self.layer = layer
        self.heads, self.kv_heads, self.head_dim = shard.heads, shard.kv_heads, cfg.head_dim
        self.q_size = self.heads * self.head_dim
        self.kv_size = self.kv_heads * self.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=opts.qkv_bias)
        self.o_proj = RowParallelLinear(self.q_size, cfg.hidden_size, opts.o_bias, tp)
        norm = opts.norm
        self.q_norm = norm(self.head_dim, cfg.rms_norm_eps) if opts.qk_norm else None
        self.k_norm = norm(self.head_dim, cfg.rms_norm_eps) if opts.qk_norm else None

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn: AttentionBackend,
        batch: ForwardBatch,
    ) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        lora = getattr(batch, "lora", None)
        if lora is not None:
            qkv = lora.add(qkv, self.layer, "qkv", x)
        qk_size = self.q_size + self.kv_size
        v = qkv[:, qk_size:].view(-1, self.kv_heads, self.head_dim)
        if self.q_norm is None:
            # One rotary pass over the query and key heads together: fewer ops per layer.
            qk = apply_rope(qkv[:, :qk_size].view(-1, self.heads + self.kv_heads, self.head_dim), cos, sin)
            q, k = qk.split((self.heads, self.kv_heads), dim=1)
        else:
            assert self.k_norm is not None  # made with q_norm
            q = self.q_norm(qkv[:, : self.q_size].view(-1, self.heads, self.head_dim))
            k = self.k_norm(qkv[:, self.q_size : qk_size].view(-1, self.kv_heads, self.head_dim))
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        h = attn.forward(q, k, v, self.layer, batch)
        return self.o_proj(h, None if lora is None else lambda out: lora.add(out, self.layer, "o", h))


class DecoderLayer(nn.Module):
    def __init__(
        self, cfg: ModelConfig, opts: DecoderOptions, layer: int, shard: TPLayout, tp: TPGroup,
        mlp_rows: tuple[int, int], mlp_group: TPGroup,
    ) -> None:
        super().__init__()
        self.self_attn: Attention | MLAttention = (
            MLAttention(cfg, layer, shard, tp, opts.o_bias) if cfg.mla else Attention(cfg, opts, layer, shard, tp))
        self.mlp: nn.Module
        if layer in opts.moe_layers:
            assert opts.moe is not None, "moe_layers without MoEOptions"
            self.mlp = SparseMoE(cfg.hidden_size, opts.moe, cfg.hidden_act, mlp_group)
        else:
            start, count = mlp_rows
            self.mlp = GatedMLP(cfg.hidden_size, count, cfg.hidden_act, bias=opts.mlp_bias, tp=mlp_group,
                                checkpoint_rows=(start, cfg.intermediate_size))
        # DP attention: the MLP is split over the data-parallel ranks, not over `tp`.
        self.dp_mlp = mlp_group if mlp_group is not tp else None
        norm = opts.norm
        self.input_layernorm = norm(cfg.hidden_size, cfg.rms_norm_eps)
        # Llama's pre-MLP norm; with sandwich norms (Gemma) the attention output's.
        self.post_attention_layernorm = norm(cfg.hidden_size, cfg.rms_norm_eps)
        self.pre_feedforward_layernorm = norm(cfg.hidden_size, cfg.rms_norm_eps) if opts.sandwich_norms else None
        self.post_feedforward_layernorm = norm(cfg.hidden_size, cfg.rms_norm_eps) if opts.sandwich_norms else None

    def forward(self, x, cos, sin, attn: AttentionBackend, batch: ForwardBatch) -> torch.Tensor:
        h = self.self_attn(self.input_layernorm(x), cos, sin, attn, batch)
        lora = getattr(batch, "lora", None)
        if self.pre_feedforward_layernorm is None:
            x = x + h
            return x + self.mlp_forward(self.post_attention_layernorm(x), batch.dp_tokens, lora)
        assert self.post_feedforward_layernorm is not None
        x = x + self.post_attention_layernorm(h)
        h = self.mlp_forward(self.pre_feedforward_layernorm(x), batch.dp_tokens, lora)
        return x + self.post_feedforward_layernorm(h)

    def mlp_forward(self, h: torch.Tensor, dp_tokens: list[int] | None, lora: Any = None) -> torch.Tensor:
        if lora is not None and lora.weights.mlp:  # LoRA on a dense model, not DP attention (spec.py checks)
            mlp, layer = self.mlp, self.self_attn.layer
            assert isinstance(mlp, GatedMLP) and self.dp_mlp is None
            gate, up = lora.add(mlp.gate_up_proj(h), layer, "gate_up", h).split(mlp.intermediate, -1)
            act = mlp.act(gate) * up
            return mlp.down_proj(act, lambda out: lora.add(out, layer, "down", act))
        if self.dp_mlp is None:
            return self.mlp(h)
        assert dp_tokens is not None, "DP attention: a forward needs every rank's token count"
        return dp_gathered_mlp(self.mlp, h, dp_tokens, self.dp_mlp)


class DecoderBody(nn.Module):
    def __init__(
        self, cfg: ModelConfig, opts: DecoderOptions, shard: TPLayout, tp: TPGroup, mlp_rows: tuple[int, int],
        mlp_group: TPGroup,
    ) -> None:
        super().__init__()
        start, rows = shard.vocab_rows()
        self.embed_tokens = VocabParallelEmbedding(rows, cfg.hidden_size, start, tp)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, opts, i, shard, tp, mlp_rows, mlp_group) for i in range(cfg.num_layers)
        )
        self.norm = opts.norm(cfg.hidden_size, cfg.rms_norm_eps)


class DecoderLM(CausalLM):
    """The Llama-like causal LM; a family subclasses it to read its `DecoderOptions` from its
    config (`options`), and names the subclass after its Hugging Face architecture."""

    stacked_params = (
        ("qkv_proj", "q_proj", 0),
        ("qkv_proj", "k_proj", 1),
        ("qkv_proj", "v_proj", 2),
    )
    lm_head: nn.Linear | None

    @classmethod
    def options(cls, raw: dict[str, Any]) -> DecoderOptions:
        """The family's options, from its raw config.json."""
        return DecoderOptions()

    def __init__(
        self, cfg: ModelConfig, shard: TPLayout | None = None, tp: TPGroup | None = None,
        mlp_group: TPGroup | None = None,
    ) -> None:
        super().__init__(cfg, shard, tp, mlp_group)
        self.opts = opts = self.options(cfg.raw)
        self.model = DecoderBody(cfg, opts, self.shard, self.tp, self.mlp_rows, self.mlp_group)
        vocab_rows = self.shard.vocab_rows()[1]
        self.lm_head = None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, vocab_rows, bias=False)
        self.embed_scale = cfg.hidden_size**0.5 if opts.scale_embeddings else None
        self.init_buffers("meta")

    def init_buffers(self, device: torch.device | str) -> None:
        cfg, meta = self.config, torch.device(device).type == "meta"
        self.rotary = RotaryEmbedding(cfg.rope, cfg.rotary_dim, cfg.max_position_embeddings, meta=meta).to(device)
        # Gemma 3's sliding layers turn at another base.
        self.rotary_local = None if cfg.local_rope is None else RotaryEmbedding(
            cfg.local_rope, cfg.rotary_dim, cfg.max_position_embeddings, meta=meta).to(device)

    def shard_sizes(self, fused: str) -> tuple[int, ...]:
        if fused == "qkv_proj":
            kv = self.shard.kv_rows()[1]
            return (self.shard.q_rows()[1], kv, kv)
        raise KeyError(fused)

    def forward(self, input_ids: torch.Tensor, batch: ForwardBatch, attn: AttentionBackend) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        if self.embed_scale is not None:  # sqrt(hidden) rounded to the model's dtype, as transformers'
            x = x * x.new_tensor(self.embed_scale)
        # LongRoPE's long rows read past the short table (ForwardBatch.rope_positions).
        positions = getattr(batch, "rope_positions", None)
        positions = batch.positions if positions is None else positions
        tables = self.rotary.tables(positions, x.dtype)
        local = tables if self.rotary_local is None else self.rotary_local.tables(positions, x.dtype)
        for layer, window in zip(self.model.layers, self.config.sliding_windows):
            cos, sin = local if window is not None else tables
            x = layer(x, cos, sin, attn, batch)
        return x

    def idle_forward(self, dp_tokens: list[int]) -> None:
        weight = self.model.embed_tokens.weight
        empty = weight.new_zeros((0, self.config.hidden_size))
        for layer in self.model.layers:
            assert isinstance(layer, DecoderLayer)  # nn.ModuleList types its items as Module
            layer.mlp_forward(empty, dp_tokens)

    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.norm(hidden)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        hidden = self.final_norm(hidden)
        logits = vocab_logits(hidden, self._head_weight(), self.config.vocab_size, self.tp)
        cap = self.opts.final_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def _head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def projection_weights(self) -> list[torch.Tensor]:
        """The float weights `linear` multiplies by (linear.pack): every projection's (not those a
        quantized layer replaced) and the LM head's."""
        found = [m.weight for m in self.modules()
                 if isinstance(m, Linear) or (isinstance(m, RowParallelLinear) and m.local is None)]
        head = self._head_weight()
        return found if any(w is head for w in found) else [*found, head]
