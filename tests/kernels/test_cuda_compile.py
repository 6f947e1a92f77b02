"""The kernels compile for a CUDA GPU (sm_90) on this CPU-only machine: the interpreter runs the
kernels' Python, not Triton's compiler, which rejects what the interpreter lets through (types of
loop-carried values, unsupported constructs)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")


def _has_cuda_backend() -> bool:
    try:
        from triton.backends.nvidia import compiler  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.skipif(not _has_cuda_backend(), reason="triton has no CUDA backend here")
def test_every_kernel_compiles_for_sm90():
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1"}
    script = Path(__file__).with_name("cuda_compile.py")
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    kernels = {r["kernel"]: r for r in map(json.loads, proc.stdout.splitlines())}
    assert set(kernels) == {
        "_sample_kernel", "_threshold_kernel", "_argmax_kernel", "_uniform_kernel", "_penalties_kernel", "_logprobs_kernel",
        "_quant_fp8_kernel", "_fp8_matmul_kernel", "_int4_matmul_kernel", "_quant_int8_kernel", "_int8_matmul_kernel",
        "_llm_int8_matmul_kernel",
        "_grouped_gemm_kernel", "_grouped_gemm_fp8_kernel", "_grouped_gemm_int8_kernel", "_grouped_gemm_int4_kernel",
        "_mx_quant_kernel", "_extend_kernel", "_decode_split_kernel", "_decode_merge_kernel",
    }
    assert all(r["ptx_chars"] > 1000 for r in kernels.values())
    # Penalties: no FMA, so that freq * count + pres rounds as torch's does.
    assert not kernels["_penalties_kernel"]["fma"]
    # Softmax probabilities use libdevice's exp (CUDA's expf, as torch), not tl.exp's ex2.approx.
    assert not kernels["_sample_kernel"]["fast_exp"] and not kernels["_logprobs_kernel"]["fast_exp"]
    # The FP8 block GEMM multiplies FP8 tiles on the tensor cores (not upcast), and activations
    # are rounded to FP8 to nearest even, as torch rounds (the interpreter cannot show either).
    assert kernels["_fp8_matmul_kernel"]["fp8_mma"] and kernels["_quant_fp8_kernel"]["fp8_cvt_rn"]
    # The int8 GEMMs multiply int8 tiles on the tensor cores; the int8 quantizer keeps its
    # add-and-subtract of 1.5 * 2^23 (round half to even), which fast math would fold away.
    assert kernels["_int8_matmul_kernel"]["int8_mma"] and kernels["_grouped_gemm_int8_kernel"]["int8_mma"]
    assert kernels["_llm_int8_matmul_kernel"]["int8_mma"]  # LLM.int8's codes too, beside its outliers' product
    assert kernels["_quant_int8_kernel"]["rounder"]
    # MXFP8's input quantizer rounds to e4m3 by the same add-and-subtract, with no FMA to fold it.
    assert kernels["_mx_quant_kernel"]["rounder"] and not kernels["_mx_quant_kernel"]["fma"]
