"""The compiled attention kernels on CUDA against the float64 reference (the interpreted ones are
checked in test_attention_kernels.py, with the same cases and bounds)."""

import random

import pytest
import torch

pytest.importorskip("triton")

from kernel_helpers import INTERPRETED  # noqa: E402
from test_attention_kernels import bound, make_case, random_rows  # noqa: E402

from batonlm.kernels.attention import (  # noqa: E402
    PagedBatch,
    decode_attention_triton,
    extend_attention_triton,
    paged_attention_reference,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(INTERPRETED, reason="compiled kernels only (TRITON_INTERPRET=1 is set)"),
]


def _cuda(batch: PagedBatch) -> PagedBatch:
    return PagedBatch(batch.req_to_token.cuda(), batch.req_slots.cuda(), batch.prefix_lens.cuda(),
                      batch.extend_lens.cuda(), batch.extend_starts.cuda(), batch.max_extend_len, batch.max_seq_len)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d, heads, kv_heads", [(64, 8, 2), (128, 32, 8), (80, 4, 4)])
@pytest.mark.parametrize("window", [None, 64])
@pytest.mark.parametrize("decode", [False, True])
def test_compiled_kernels_equal_the_reference(dtype, d, heads, kv_heads, window, decode):
    rng = random.Random(d + heads)
    q, k, v, batch = make_case(random_rows(rng, 12, decode), heads, kv_heads, d, dtype, seed=d)
    scale = d**-0.5
    kernel = decode_attention_triton if decode else extend_attention_triton
    got = kernel(q.cuda(), k.cuda(), v.cuda(), _cuda(batch), scale, window).cpu()
    exact = paged_attention_reference(q.double(), k.double(), v.double(), batch, scale, window)
    err = (got.double() - exact).abs()
    tol = bound(q, k, v, batch, scale, dtype)
    assert bool((err <= tol).all()), f"error {err.max():.3g}, bound {tol.min():.3g}"
