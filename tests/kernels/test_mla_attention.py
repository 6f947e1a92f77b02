"""Multi-head latent attention through the paged attention kernels (models/mla.py): the pool
holds one latent "head" per token ([c, k_pe]) passed as both keys and values, the queries carry
W_UK absorbed, the outputs W_UV applied after. In float64 that equals per-head attention over the
expanded keys and values (the algebra of absorption); in float32 the kernels are within their
rounding bound of the float64 reference on the aliased pool (test_attention_kernels.check)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kernel_helpers import interpreted_only  # noqa: E402
from test_attention_kernels import check, make_case  # noqa: E402

from batonlm.kernels.attention import (  # noqa: E402
    decode_attention_triton,
    extend_attention_triton,
    paged_attention_reference,
)

pytestmark = interpreted_only
HEADS, RANK, ROPE, NOPE, V = 4, 32, 16, 24, 20


def _mla_case(rows, seed):
    """A latent pool [1, slots, RANK + ROPE], queries [T, H, NOPE + ROPE] and kv_b_proj per head."""
    _, pool, _, batch = make_case(rows, HEADS, 1, RANK + ROPE, torch.float64, seed)
    g = torch.Generator().manual_seed(seed + 1)
    t = int(batch.extend_lens.sum())
    q = torch.randn(t, HEADS, NOPE + ROPE, generator=g, dtype=torch.float64)
    w = torch.randn(HEADS, NOPE + V, RANK, generator=g, dtype=torch.float64) * 0.3
    return q, pool, w, batch


def _absorbed_query(q, w):
    q_latent = torch.einsum("thn,hnr->thr", q[..., :NOPE], w[:, :NOPE])
    return torch.cat((q_latent, q[..., NOPE:]), dim=-1)


def _heads_out(latent_out, w):
    return torch.einsum("thr,hvr->thv", latent_out[..., :RANK], w[:, NOPE:])


def _per_head_reference(q, pool, w, batch, scale):
    """Unabsorbed: every head's keys [W_UK c, k_pe] and values W_UV c, then causal attention."""
    c, k_pe = pool[0, :, :RANK], pool[0, :, RANK:]
    keys = torch.cat((torch.einsum("hnr,sr->hsn", w[:, :NOPE], c), k_pe.expand(HEADS, -1, -1)), dim=-1)
    values = torch.einsum("hvr,sr->hsv", w[:, NOPE:], c)
    out = torch.empty(q.shape[0], HEADS, V, dtype=torch.float64)
    for b in range(batch.req_slots.shape[0]):
        start, n, p = int(batch.extend_starts[b]), int(batch.extend_lens[b]), int(batch.prefix_lens[b])
        slots = batch.req_to_token[batch.req_slots[b], : p + n]
        scores = torch.einsum("nhd,hld->hnl", q[start : start + n], keys[:, slots]) * scale
        visible = torch.arange(p + n)[None, :] <= (p + torch.arange(n))[:, None]
        probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
        out[start : start + n] = torch.einsum("hnl,hlv->nhv", probs, values[:, slots])
    return out


ROWS = {"extend": [(0, 9), (17, 5), (40, 1), (3, 12)], "decode": [(0, 1), (30, 1), (77, 1), (5, 1)]}


@pytest.mark.parametrize("kernel", ["extend", "decode"])
def test_latent_attention_equals_per_head_attention(kernel):
    q, pool, w, batch = _mla_case(ROWS[kernel], seed=11)
    scale = (NOPE + ROPE) ** -0.5
    # The algebra, in float64: absorbed attention over the latent pool == per-head attention.
    absorbed = paged_attention_reference(_absorbed_query(q, w), pool, pool, batch, scale)
    want = _per_head_reference(q, pool, w, batch, scale)
    assert torch.allclose(_heads_out(absorbed, w), want, rtol=1e-10, atol=1e-12)
    # The kernel, in float32, on one pool tensor passed as keys and values.
    q32, pool32 = _absorbed_query(q, w).float(), pool.float()
    run = extend_attention_triton if kernel == "extend" else decode_attention_triton
    got = run(q32, pool32, pool32, batch, scale)
    check(got, q32, pool32, pool32, batch, scale, None, torch.float32)


def test_the_check_sees_the_rope_part_left_out_of_the_values():
    """A pool whose values were only the latent's first features (the rotary part zeroed) gives
    other outputs in those features only: what the model drops must be what differs."""
    q, pool, w, batch = _mla_case(ROWS["extend"], seed=12)
    scale = (NOPE + ROPE) ** -0.5
    qa = _absorbed_query(q, w)
    values = pool.clone()
    values[..., RANK:] = 0
    full = paged_attention_reference(qa, pool, pool, batch, scale)
    latent_only = paged_attention_reference(qa, pool, values, batch, scale)
    assert torch.equal(full[..., :RANK], latent_only[..., :RANK])
    assert not torch.allclose(full[..., RANK:], latent_only[..., RANK:])
