"""The torch attention backend against plain per-request causal attention."""

import pytest
import torch

from batonlm.model_runner.attention.torch_backend import TorchAttentionBackend
from batonlm.model_runner.forward_batch import ForwardBatch
from batonlm.model_runner.kv_pool import KVPool
from batonlm.model_runner.req_to_token import ReqToTokenPool

H, KVH, D = 4, 2, 8


def naive(q, k, v, window=None):
    """q: [n, H, D] at positions p0..p0+n-1 over keys k/v: [L, KVH, D] (positions 0..L-1)."""
    n, L = q.shape[0], k.shape[0]
    k = k.repeat_interleave(H // KVH, dim=1)
    v = v.repeat_interleave(H // KVH, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * D**-0.5
    qpos = torch.arange(L - n, L)[:, None]
    kpos = torch.arange(L)[None, :]
    mask = kpos <= qpos
    if window is not None:
        mask &= kpos > qpos - window
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, H * D)


@pytest.mark.parametrize("window", [None, 5])
def test_mixed_prefills_and_decodes_match_per_request_attention(window):
    torch.manual_seed(0)
    pool = KVPool(200, 1, KVH, D, torch.float32, "cpu")
    r2t = ReqToTokenPool(8, 64, "cpu")
    backend = TorchAttentionBackend(pool, r2t, H, KVH, D, (window,))
    # Rows: a fresh prefill of 7, an extend of 3 over a cached prefix of 9, decodes at positions 12 and 4.
    rows = [(0, 0, 7), (3, 9, 3), (5, 12, 1), (6, 4, 1)]  # (req_slot, prefix_len, extend_len)
    next_slot = 1
    full_k, full_v = {}, {}
    for slot, prefix, ext in rows:
        full_k[slot] = torch.randn(prefix + ext, KVH, D)
        full_v[slot] = torch.randn(prefix + ext, KVH, D)
        # The cached prefix is already in the pool.
        kv_slots = torch.arange(next_slot, next_slot + prefix + ext)
        next_slot += prefix + ext
        r2t.table[slot, : prefix + ext] = kv_slots
        pool.write(0, kv_slots[:prefix], full_k[slot][:prefix], full_v[slot][:prefix])
    out_loc = torch.cat([r2t.table[s, p : p + e] for s, p, e in rows])
    batch = ForwardBatch.build(out_loc, [r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows], "cpu")
    backend.prepare(batch)
    q = {s: torch.randn(e, H, D) for s, _, e in rows}
    out = backend.forward(
        torch.cat([q[s] for s, _, _ in rows]),
        torch.cat([full_k[s][p:] for s, p, _ in rows]),
        torch.cat([full_v[s][p:] for s, p, _ in rows]),
        0,
        batch,
    )
    offset = 0
    for s, _p, e in rows:
        want = naive(q[s], full_k[s], full_v[s], window)
        torch.testing.assert_close(out[offset : offset + e], want, rtol=1e-5, atol=1e-5)
        offset += e
