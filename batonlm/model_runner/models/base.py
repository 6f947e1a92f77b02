"""`CausalLM`: what every model family gives the model runner, the loader and the decode graphs.

`batonlm.registries.MODEL_ARCHITECTURES` maps a Hugging Face architecture name (config.json's
`architectures[0]`) to a subclass; `model_loader.load_model` builds it on the meta device as
`cls(cfg, shard, tp, mlp_group)`, moves it to the device (`init_buffers` then recomputes what no
checkpoint holds) and fills it with `weight_loader.load_weights`. Everything a family reads from
its config (biases, norms) it reads in its constructor, from `cfg.raw`.

The weight loader reads the attributes set here (`config`, `shard`, `tp`, `stacked_params`,
`shard_sizes`, `lm_head`, and for mixtures of experts `expert_weight_names`,
`checkpoint_renames`, `weight_target`) and Hugging Face's Llama parameter names: q/k/v are column-parallel
(`stacked_params` names the fused parameter they fill), `o_proj` row-parallel, `embed_tokens`
and `lm_head` split by vocabulary row; a `GatedMLP` (its gate/up rows, its down columns) and
`FusedExperts` say which features they hold themselves.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch
from torch import nn

from batonlm.distributed.group import TPGroup
from batonlm.distributed.layout import TPLayout, split_evenly
from batonlm.model_runner.attention.base import AttentionBackend
from batonlm.model_runner.forward_batch import ForwardBatch
from batonlm.model_runner.model_config import ModelConfig


def single_layout(cfg: ModelConfig) -> TPLayout:
    """The whole model on one rank."""
    return TPLayout.single(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size, cfg.vocab_size)


class CausalLM(nn.Module, ABC):
    """A causal LM, or under tensor parallelism this rank's part of one (`shard`: its heads, KV
    heads, intermediate features and vocabulary rows; `tp`: the group its row-parallel layers
    sum over). With DP attention (`mlp_group`: the data-parallel ranks) it holds all of attention
    and its share of the MLP among those ranks."""

    # (fused parameter, checkpoint tensor it holds a slice of, the slice's index in the fused
    # parameter's first dimension); `shard_sizes` gives the slices' sizes on this rank.
    stacked_params: tuple[tuple[str, str, int], ...] = ()
    # Mixture of experts (moe.py): each expert's gate, up and down projection in the checkpoint
    # (`<layer's MoE module>.experts.<e>.<name>.weight`), which fill the fused `experts.w13`/`w2`.
    expert_weight_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    # (fragment of a parameter's name here, what the checkpoint calls it) where they differ.
    checkpoint_renames: tuple[tuple[str, str], ...] = ()
    # The LM head, or None when it is tied to the embedding (the checkpoint's is then skipped).
    lm_head: nn.Module | None
    # Whether its attention layers have sinks (a logit per head in the softmax's denominator).
    attention_sinks: bool = False

    def __init__(
        self, cfg: ModelConfig, shard: TPLayout | None = None, tp: TPGroup | None = None,
        mlp_group: TPGroup | None = None,
    ) -> None:
        super().__init__()
        self.config = cfg
        self.shard = shard or single_layout(cfg)
        self.tp = tp or TPGroup.single()
        self.mlp_group = mlp_group or self.tp
        # (start, count) of the intermediate features this rank holds: its tensor-parallel
        # share, or with DP attention its share among the data-parallel ranks.
        self.mlp_rows = self.shard.mlp_rows() if mlp_group is None else \
            split_evenly(cfg.intermediate_size, mlp_group.size, mlp_group.rank)

    @abstractmethod
    def forward(self, input_ids: torch.Tensor, batch: ForwardBatch, attn: AttentionBackend) -> torch.Tensor:
        """The hidden states of the batch's tokens ([T, hidden]; `logits` applies the final
        norm), writing their K/V through `attn`. `batch` may be any object with the fields the
        model and `attn` read (`positions`, `dp_tokens`, ...): the decode graphs pass their own."""

    @abstractmethod
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits over the whole vocabulary ([N, vocab_size], gathered over the ranks)
        of the hidden states `forward` returned for N selected tokens."""

    def projection_weights(self) -> list[torch.Tensor]:
        """The weights batonlm's own `linear` multiplies by, for linear.pack (none: a model
        whose code is not batonlm's)."""
        return []

    @abstractmethod
    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        """The model's last hidden states (transformers' `last_hidden_state`: after the final
        norm) of hidden states `forward` returned: what embeddings pool."""

    @abstractmethod
    def idle_forward(self, dp_tokens: list[int]) -> None:
        """DP attention, a rank with no tokens this iteration: take part in the collectives the
        other ranks' forward waits on (every layer's MLP over their tokens)."""

    def init_buffers(self, device: torch.device | str) -> None:
        """Recompute on `device` the buffers no checkpoint holds (rotary tables): the loader
        builds the model on the meta device, so they hold nothing after `to_empty`."""

    def weight_target(self, param_name: str, name: str, p: torch.Tensor) -> Any:
        """Where this rank's part of checkpoint tensor `name` goes (a `weight_loader.Target`)
        when the family splits it otherwise than the Llama layout; None: the Llama layout."""
        return None

    def shard_sizes(self, fused: str) -> tuple[int, ...]:
        """The rows of each checkpoint tensor the fused parameter `fused` holds, on this rank."""
        raise KeyError(fused)
