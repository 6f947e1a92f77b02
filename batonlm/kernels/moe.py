"""Mixture-of-experts: each token's hidden state through its top-k experts' gated MLPs, summed
with its routing weights. Formulations of the same sum, and a Triton kernel (their skeletons,
`grouped_by_expert`, `dense_by_expert`, `gathered_by_expert` and `aligned_by_expert`, take the
experts' MLP as a function, so the quantized experts of moe_fp8.py, moe_int8.py and moe_int4.py
only say how their weights multiply):

- `fused_moe_reference`: the meaning, one expert at a time over the rows routed to it (what
  transformers computes), in any dtype; the tests run it in float64.
- `fused_moe_grouped`: the eager CPU path. The (token, k) pairs are sorted by expert once; each
  expert with rows takes one matmul per projection over its contiguous segment (a loop over the
  experts that have tokens, never over tokens).
- `fused_moe_grouped_op`: the grouped path as one opaque op (`batonlm::moe_grouped`), which a
  compiled graph calls as it is: the CPU's compiled step's 2-64 row graph, float experts.
- `fused_moe_dense`: every expert over every token, the unrouted products weighted by exact
  zeros. Shapes depend only on the batch size, so it traces into a compiled graph (the quantized
  experts' formulations in the CPU's compiled 2-64 row graph, where their int8 / FP8 products
  gain from it).
- `fused_moe_gathered`: each routed pair's expert weights gathered, one batched matmul: shapes
  fixed by the batch size too, reading T * K experts rather than E (the compiled step's choice
  when that is fewer: one token of a model with many experts).
- `fused_moe_triton` (CUDA): the pairs sorted by expert and padded to the kernel's row block
  (`moe_align`), one grouped GEMM launch per projection (`_triton_moe.py`); every shape depends
  only on the batch size, so a CUDA graph captures it.

Weights: `w13` [E, 2 * I, H] (gate rows then up rows, each expert's fused gate/up projection),
`w2` [E, H, I]. `topk_ids` / `topk_weights` [T, K]. Each formulation adds a token's K weighted
expert outputs in ascending expert order, as transformers' loop over experts does, so with equal
products the sums are equal to the bit.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

Activation = Callable[[torch.Tensor], torch.Tensor]
# (x, w13, w2, topk_ids, topk_weights, act) -> [T, H]: each formulation below.
MoEFunction = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, Activation], torch.Tensor
]


def sort_by_expert(topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's K choices in ascending expert order (the order their outputs are added)."""
    ids, order = topk_ids.sort(dim=1, stable=True)
    return ids, topk_weights.gather(1, order)


def gated(h: torch.Tensor, act: Activation) -> torch.Tensor:
    gate, up = h.chunk(2, dim=-1)
    return act(gate) * up


def weighted_sum(y: torch.Tensor, weights: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """y [T, K, H] expert outputs (ascending expert order per token), weights [T, K] ->
    [T, H]: (((0 + w0 y0) + w1 y1) + ...), each product rounded to `out_dtype` as transformers'
    index_add does."""
    out = torch.zeros(y.shape[0], y.shape[2], dtype=out_dtype, device=y.device)
    for k in range(y.shape[1]):
        out = out + (y[:, k] * weights[:, k, None]).to(out_dtype)
    return out


def fused_moe_reference(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
    act: Activation = F.silu,
) -> torch.Tensor:
    """One expert at a time (ascending), over the rows routed to it, accumulated with index_add."""
    out = torch.zeros_like(x)
    for e in range(w13.shape[0]):
        token, slot = torch.where(topk_ids == e)
        if token.numel() == 0:
            continue
        y = F.linear(gated(F.linear(x[token], w13[e]), act), w2[e])
        out.index_add_(0, token, (y * topk_weights[token, slot, None]).to(x.dtype))
    return out


def grouped_by_expert(
    x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, num_experts: int, hidden_out: int,
    mlp: Callable[[int, torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """The (token, k) pairs sorted by expert; `mlp(e, rows)` once per expert that has rows (its
    output [rows, hidden_out]); the token's outputs weighted and summed in ascending expert order."""
    t, k = topk_ids.shape
    ids, weights = sort_by_expert(topk_ids, topk_weights)
    flat = ids.flatten()
    order = flat.argsort(stable=True)
    rows = x[order // k]
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    y = torch.empty((t * k, hidden_out), dtype=x.dtype, device=x.device)
    start = 0
    for e, n in enumerate(counts):
        if n:
            y[order[start : start + n]] = mlp(e, rows[start : start + n])
            start += n
    return weighted_sum(y.view(t, k, -1), weights, x.dtype)


def fused_moe_grouped(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
    act: Activation = F.silu,
) -> torch.Tensor:
    """The (token, k) pairs sorted by expert; one matmul pair per expert that has rows."""
    return grouped_by_expert(x, topk_ids, topk_weights, w13.shape[0], w2.shape[1],
                             lambda e, seg: F.linear(gated(F.linear(seg, w13[e]), act), w2[e]))


ACTIVATIONS: dict[str, Activation] = {"silu": F.silu, "gelu": F.gelu,
                                      "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}
_ACTIVATION_NAMES = {fn: name for name, fn in ACTIVATIONS.items()}


@torch.library.custom_op("batonlm::moe_grouped", mutates_args=())
def _moe_grouped_op(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
                    topk_weights: torch.Tensor, act: str) -> torch.Tensor:
    return fused_moe_grouped(x, w13, w2, topk_ids, topk_weights, ACTIVATIONS[act])


@_moe_grouped_op.register_fake
def _(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
      act: str) -> torch.Tensor:
    return x.new_empty((x.shape[0], w2.shape[1]))


def fused_moe_grouped_op(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
    act: Activation = F.silu,
) -> torch.Tensor:
    """`fused_moe_grouped` as one opaque op (`batonlm::moe_grouped`): a compiled graph calls it
    as it is, its loop over the experts that have rows run eagerly inside, where tracing would
    need shapes fixed by the batch size (the dense formulation). `act`: one of `ACTIVATIONS`."""
    return _moe_grouped_op(x, w13, w2, topk_ids, topk_weights, _ACTIVATION_NAMES[act])


def fused_moe_dense(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
    act: Activation = F.silu,
) -> torch.Tensor:
    """Every expert over every token (batched matmuls over [E, T, .])."""
    def mlp(x: torch.Tensor) -> torch.Tensor:
        return torch.matmul(gated(torch.matmul(x.unsqueeze(0), w13.transpose(1, 2)), act), w2.transpose(1, 2))

    return dense_by_expert(x, topk_ids, topk_weights, w13.shape[0], mlp)


def fused_moe_gathered(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
    act: Activation = F.silu,
) -> torch.Tensor:
    """Each (token, k) pair's expert weights gathered and multiplied in one batched matmul."""
    def mlp(rows: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        return torch.bmm(gated(torch.bmm(rows, w13[experts].transpose(1, 2)), act), w2[experts].transpose(1, 2))

    return gathered_by_expert(x, topk_ids, topk_weights, mlp)


def dense_by_expert(
    x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, num_experts: int,
    mlp: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """`mlp(x)`: every expert's MLP over every token, [E, T, H]; weighted by the routing weight
    or an exact zero: the products a token was routed to are those of the grouped path, and
    adding zeros changes no sum. Shapes depend only on the batch size."""
    ids, weights = sort_by_expert(topk_ids, topk_weights)
    dense = torch.zeros(x.shape[0], num_experts, dtype=weights.dtype, device=x.device).scatter(1, ids, weights)
    return weighted_sum(mlp(x).transpose(0, 1), dense, x.dtype)  # over all experts, ascending (zeros exact)


def gathered_by_expert(
    x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
    mlp: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """`mlp(rows, experts)`: each (token, k) pair's row [T * K, 1, H] through its expert
    (`experts` [T * K], each token's ascending), [T * K, 1, H]. Shapes depend only on the batch
    size, as the dense formulation's, but T * K experts are read instead of all E (the compiled
    step's choice at decode sizes, T * K < E)."""
    ids, weights = sort_by_expert(topk_ids, topk_weights)
    rows = x.repeat_interleave(topk_ids.shape[1], dim=0).unsqueeze(1)
    return weighted_sum(mlp(rows, ids.flatten()).view(*topk_ids.shape, -1), weights, x.dtype)


def aligned_by_expert(
    x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, num_experts: int,
    mlp: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """`mlp(sorted_ids, block_expert, pair_expert)`: the pairs grouped by expert in the Triton
    kernels' row blocks (`moe_align`), each pair's output written at its index t * K + k, [T * K,
    H]; `pair_expert` [T * K]: each pair's expert (by that index)."""
    from batonlm.kernels._triton_moe import BLOCK_M

    ids, weights = sort_by_expert(topk_ids, topk_weights)
    sorted_ids, block_expert = moe_align(ids, num_experts, BLOCK_M)
    return weighted_sum(mlp(sorted_ids, block_expert, ids.flatten()).view(*topk_ids.shape, -1), weights, x.dtype)


# Quantized experts' static activation scales: each expert's (gate/up's [E], down's [E]), or None.
StaticScales = tuple[torch.Tensor, torch.Tensor] | None


def expert_scales(input_scales: StaticScales, e: int | torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Expert e's (or a tensor of experts': theirs, gathered) static input scales, or (None, None)."""
    return (None, None) if input_scales is None else (input_scales[0][e], input_scales[1][e])


def check_input_scales(input_scales: StaticScales, experts: int, allowed: bool = True) -> None:
    """Quantized experts' static activation scales: (gate/up's, down's) float32 [E] each, where
    the format takes them (`allowed`)."""
    if input_scales is None:
        return
    if not allowed:
        raise ValueError("input_scales: static activation scales go with per-channel weights only (block None)")
    for a in input_scales:
        if a.dtype != torch.float32 or tuple(a.shape) != (experts,):
            raise ValueError(f"input_scales: expected two float32 [{experts}] (each expert's), got {a.dtype} "
                             f"{list(a.shape)}")


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The (token, k) pairs grouped by expert, each group padded to a multiple of `block_m`:
    `sorted_ids` [P] (a pair's flat index t * K + k, or T * K for padding) and `block_expert`
    [P / block_m] (the expert of each row block, `num_experts` for blocks past the last group).
    P = T * K + E * (block_m - 1) rounded up to block_m: it depends only on the batch size, and
    every op here is one a CUDA graph captures (no host synchronisation)."""
    flat = topk_ids.flatten()
    n = flat.numel()
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device).scatter_add_(
        0, flat, torch.ones_like(flat)
    )
    padded = (counts + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)
    starts = ends - padded
    order = flat.argsort(stable=True)
    by_expert = flat[order]
    first_of_expert = counts.cumsum(0) - counts
    pos = starts[by_expert] + torch.arange(n, device=flat.device) - first_of_expert[by_expert]
    size = -(-(n + num_experts * (block_m - 1)) // block_m) * block_m
    sorted_ids = torch.full((size,), n, dtype=torch.int64, device=flat.device).scatter(0, pos, order)
    block_starts = torch.arange(0, size, block_m, device=flat.device)
    block_expert = torch.searchsorted(ends, block_starts, right=True)
    return sorted_ids, block_expert


def fused_moe_triton(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
    act: Activation = F.silu,
) -> torch.Tensor:
    """`fused_moe_grouped` as two grouped GEMM launches (the activation between them in torch)."""
    from batonlm.kernels import _triton_moe

    pairs, k = topk_ids.numel(), topk_ids.shape[1]

    def mlp(sorted_ids: torch.Tensor, block_expert: torch.Tensor, _: torch.Tensor) -> torch.Tensor:
        h = _triton_moe.grouped_gemm(x, w13, sorted_ids, block_expert, rows=pairs, a_row_div=k)  # [T*K, 2I]
        return _triton_moe.grouped_gemm(gated(h, act), w2, sorted_ids, block_expert, rows=pairs, a_row_div=1)

    return aligned_by_expert(x, topk_ids, topk_weights, w13.shape[0], mlp)
