"""The layers whose weights a tensor-parallel rank holds only a part of (distributed/layout.py).

Column-parallel projections need no layer of their own (an `nn.Linear` with the rank's output
features; the loader fills the rows). Row-parallel projections sum their partial products over
the ranks; the vocabulary-parallel embedding looks up the ids in its rows and sums (the other
ranks add exact zeros); the LM head gathers each rank's vocabulary logits. With one rank each
is the plain layer, operation for operation (greedy outputs match transformers). DP attention
(`dp_gathered_mlp`) splits only the MLP, over the data-parallel ranks.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from batonlm.distributed.group import TPGroup
from batonlm.model_runner.linear import linear


class RowParallelLinear(nn.Module):
    """y = sum over ranks of x_r @ W_r^T, then the bias once (after the sum, on every rank).
    `local`: the rank's product by a quantized weight in place of `weight` (quantization/resident.py).
    `delta` (LoRA) adds to the product: after the bias on one rank, to each rank's partial sum
    before the all-reduce under tensor parallelism."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPGroup) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.tp = tp
        self.local: nn.Module | None = None

    def forward(self, x: torch.Tensor, delta: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
        if self.tp.size == 1:
            y = linear(x, self.weight, self.bias) if self.local is None else self.local(x)
            if self.local is not None and self.bias is not None:
                y = y + self.bias
            return y if delta is None else delta(y)
        y = linear(x, self.weight) if self.local is None else self.local(x)
        y = self.tp.all_reduce(y if delta is None else delta(y))
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Rows [start, start + rows) of the (padded) vocabulary's embedding."""

    def __init__(self, rows: int, dim: int, start: int, tp: TPGroup) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, dim))
        self.start = start
        self.tp = tp

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(out.masked_fill(outside.unsqueeze(-1), 0))


def vocab_logits(hidden: torch.Tensor, weight: torch.Tensor, vocab_size: int, tp: TPGroup) -> torch.Tensor:
    """float32 logits over the model's vocabulary from each rank's rows of the LM head."""
    local = linear(hidden, weight).float()
    if tp.size == 1:
        return local
    return tp.all_gather_last_dim(local)[..., :vocab_size]


def dp_gathered_mlp(mlp: nn.Module, x: torch.Tensor, counts: list[int], group: TPGroup) -> torch.Tensor:
    """DP attention's MLP: every data-parallel rank's tokens through the MLP split over the
    ranks (`mlp` holds this rank's intermediate features; its down projection sums over them),
    this rank's rows back. `counts` is every rank's token count this iteration (the sync row's),
    x this rank's [counts[rank], hidden]; an idle rank gives none and still takes part."""
    if counts[group.rank] != x.shape[0]:
        raise ValueError(f"DP rank {group.rank} has {x.shape[0]} tokens but the sync row says {counts[group.rank]}")
    width = max(counts)
    padded = x.new_zeros((width, x.shape[-1]))
    padded[: x.shape[0]] = x
    out = mlp(group.all_gather_rows(padded))  # rows of other ranks, and padding, are theirs/ignored
    start = group.rank * width
    return out[start : start + x.shape[0]]
