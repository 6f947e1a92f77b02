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


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("decode", [False, True])
def test_compiled_kernels_read_fp8_pools_with_their_scales(cache_dtype, decode):
    """bfloat16 queries over FP8 pools (the GPU case of --kv-cache-dtype): tiles converted to
    bfloat16 (exact) on the tensor cores, the scales applied in the kernel."""
    from test_attention_kernels import K_SCALE, V_SCALE, check, fp8_pools

    rng = random.Random(3)
    q, k, v, batch = make_case(random_rows(rng, 12, decode), 32, 8, 128, torch.float32, seed=4)
    k8, v8 = fp8_pools(k * 3, v, cache_dtype, K_SCALE, V_SCALE)
    q = q.to(torch.bfloat16)
    kernel = decode_attention_triton if decode else extend_attention_triton
    scale = 128**-0.5
    got = kernel(q.cuda(), k8.cuda(), v8.cuda(), _cuda(batch), scale, 64, k_scale=K_SCALE, v_scale=V_SCALE).cpu()
    check(got, q, k8, v8, batch, scale, 64, torch.bfloat16, K_SCALE, V_SCALE)
