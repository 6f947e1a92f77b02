"""The attention-backend interface and its registry."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
import torch.nn.functional as F

from batonlm.model_runner.forward_batch import ForwardBatch
from batonlm.model_runner.kv_pool import KVPool
from batonlm.model_runner.req_to_token import ReqToTokenPool


class AttentionBackend(ABC):
    """Paged attention over the token-level KV pool.

    `prepare` builds per-forward metadata once (shared by every layer); `forward` writes the new
    tokens' K/V into the pool and attends each query over its request's cached prefix plus the
    new tokens up to itself (causal), honouring a per-layer sliding window.
    """

    def __init__(
        self,
        kv_pool: KVPool,
        req_to_token: ReqToTokenPool,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        sliding_windows: tuple[int | None, ...],
        scale: float | None = None,
        softcap: float | None = None,
    ) -> None:
        """`head_dim`: of queries, keys and values (MLA's latent, models/mla.py); `scale`: the
        softmax scale (None: 1/sqrt(head_dim)); `softcap`: below."""
        self.kv_pool = kv_pool
        self.req_to_token = req_to_token
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.sliding_windows = sliding_windows
        self.scale = head_dim**-0.5 if scale is None else scale
        # Attention logit soft-capping (Gemma 2): scores -> cap * tanh(scores / cap) before the
        # mask and softmax; None: off. Every backend applies it.
        self.softcap = softcap
        # Attention sinks (gpt-oss, on transformers' code): the layer in progress's logit per
        # query head [H] float32, set before each call; None: none. `has_sinks`: the model has
        # them (known before a forward is prepared: the CPU's in-place decode has none).
        self.sinks: torch.Tensor | None = None
        self.has_sinks = False

    def masked_attention(
        self, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
        sink: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """softmax(scale * q k^T, where `mask`) v over gathered keys (the torch backend's and the
        compiled step's): SDPA, or with soft-capping or a sink logit per query row (`sink`,
        broadcast against the scores' last dimension), which SDPA lacks, transformers' eager order
        of operations: the sink one more column of the softmax, its weight dropped."""
        if self.softcap is None and sink is None:
            return F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, scale=self.scale)
        scores = torch.matmul(queries, keys.transpose(-1, -2)) * self.scale
        if self.softcap is not None:
            scores = torch.tanh(scores / self.softcap) * self.softcap
        scores = scores.masked_fill(~mask, float("-inf")).float()
        if sink is None:
            weights = torch.softmax(scores, dim=-1)
        else:
            sinks = sink.float().expand(*scores.shape[:-1], 1)
            weights = torch.softmax(torch.cat([scores, sinks], dim=-1), dim=-1)[..., :-1]
        return torch.matmul(weights.to(queries.dtype), values)

    @abstractmethod
    def prepare(self, batch: ForwardBatch) -> None:
        """Set `batch.attn_metadata` for this forward pass."""

    @abstractmethod
    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, batch: ForwardBatch
    ) -> torch.Tensor:
        """q: [T, heads, d], k/v: [T, kv_heads, d] -> [T, heads * d]."""
