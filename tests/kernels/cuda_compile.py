"""Compile every batonlm kernel for a CUDA target without a GPU (front end, LLVM and ptxas), the
part of a kernel the interpreter never exercises. Run by test_cuda_compile.py with
TRITON_INTERPRET=0; prints one JSON line per kernel: name, PTX size, and PTX facts the tests check.
"""

import json
import os
import sys

if os.environ.get("TRITON_INTERPRET") == "1":
    sys.exit("run with TRITON_INTERPRET=0: the interpreter's kernels cannot be compiled")

from triton import compile as triton_compile  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from batonlm.kernels import (  # noqa: E402
    _triton_attention,
    _triton_int8,
    _triton_llm_int8,
    _triton_logprobs,
    _triton_moe,
    _triton_moe_int4,
    _triton_mxfp8,
    _triton_penalties,
    _triton_quant,
    _triton_sampling,
)
from batonlm.kernels._triton_common import NO_FMA  # noqa: E402

F32, I32, I64 = "*fp32", "*i32", "*i64"
SAMPLE_ARGS = dict(temperature_ptr=F32, top_k_ptr=I64, top_p_ptr=F32, min_p_ptr=F32)
KERNELS = [
    (_triton_sampling._sample_kernel,
     dict(logits_ptr=F32, stride="i32", **SAMPLE_ARGS, keys_ptr=I64, out_ptr=I64, V="i32"),
     dict(BLOCK=1024, NT=_triton_sampling.search_width(1024)), dict(num_warps=8, **NO_FMA)),
    (_triton_sampling._threshold_kernel,
     dict(probs_ptr=F32, stride="i32", top_k_ptr=I64, top_p_ptr=F32, min_p_ptr=F32, out_ptr=F32, V="i32"),
     dict(BLOCK=1024, NT=_triton_sampling.search_width(1024)), dict(num_warps=8, **NO_FMA)),
    (_triton_sampling._argmax_kernel, dict(logits_ptr=F32, stride="i32", out_ptr=I64, V="i32"),
     dict(BLOCK=1024), dict(num_warps=4, **NO_FMA)),
    (_triton_sampling._uniform_kernel, dict(keys_ptr=I64, out_ptr=F32, V="i32"), dict(BLOCK=1024), dict(num_warps=4, **NO_FMA)),
    (_triton_penalties._penalties_kernel,
     dict(logits_ptr=F32, out_ptr=F32, stride="i32", out_stride="i32", slots_ptr=I64, counts_ptr=I32, counts_stride="i32",
          prompt_ptr="*u8", prompt_stride="i32", freq_ptr=F32, pres_ptr=F32, rep_ptr=F32, bias_ids_ptr=I64,
          bias_values_ptr=F32, n_bias="i32", banned_ptr=I64, n_banned="i32", V="i32"),
     dict(BLOCK=1024, CHUNK=_triton_penalties.LIST_CHUNK), _triton_penalties.OPTIONS),
    (_triton_logprobs._logprobs_kernel,
     dict(logits_ptr=F32, stride="i32", temperature_ptr=F32, chosen_ptr=I64, chosen_out_ptr=F32,
          top_ids_ptr=I64, top_lp_ptr=F32, V="i32", top_n="i32"),
     dict(BLOCK=1024, NP=32, WITH_TOP=True), dict(num_warps=8, **NO_FMA)),
    *((_triton_quant._quant_fp8_kernel,
       dict(x_ptr="*bf16", q_ptr="*fp8e4nv", s_ptr=F32, K="i32", group="i32", groups_per_row="i32", stride_xm="i32",
            stride_qm="i32", stride_s="i32", fp8_max="fp32", min_scale="fp32",
            amax_ub="fp32"),
       dict(STATIC=static, BLOCK=128), dict(num_warps=4, **NO_FMA)) for static in (False, True)),
    (_triton_quant._fp8_matmul_kernel,
     dict(x_ptr="*fp8e4nv", w_ptr="*fp8e4nv", y_ptr="*bf16", xs_ptr=F32, ws_ptr=F32, bias_ptr="*bf16", M="i32", N="i32",
          K="i32", block_n="i32", block_k="i32", stride_xm="i32", stride_wn="i32", stride_ym="i32", stride_xsm="i32",
          stride_xsk="i32", stride_wsn="i32", stride_wsk="i32"),
     dict(K_BLOCKED=True, HAS_BIAS=False, UPCAST=False, BLOCK_M=64, BLOCK_N=128, BLOCK_K=128),
     dict(num_warps=4, num_stages=3, **NO_FMA)),
    *((_triton_quant._int4_matmul_kernel,
       dict(x_ptr="*bf16", qw_ptr=I32, s_ptr="*u8" if scale_2 == 3 else "*fp8e4nv" if scale_2 else "*bf16", z_ptr=I32,
            cb_ptr=F32, s2_ptr=F32,
            bias_ptr="*bf16", y_ptr="*bf16", gidx_ptr=I32, M="i32", N="i32", K="i32", group="i32", stride_xm="i32",
            stride_qk="i32", stride_sg="i32", stride_zg="i32", stride_ym="i32"),
       dict(ROW_SCALES=rows, G_IDX=g_idx, HAS_BIAS=True, UPCAST=False, IEEE=False, BITS=bits, CODEBOOK=codebook,
            SCALE_2=int(scale_2) % 3, E8M0=scale_2 == 3, BLOCK_M=64, BLOCK_N=64, BLOCK_K=64),
       dict(num_warps=4, num_stages=3, **NO_FMA))
      for rows, g_idx, bits, codebook, scale_2 in (
          (False, False, 4, False, False), (False, True, 4, False, False), (False, False, 8, False, False),
          (False, True, 8, False, False), (True, False, 4, True, False), (False, False, 4, True, False),
          (False, False, 4, True, 1), (True, False, 4, True, 2), (False, False, 4, True, 3),
          (False, False, 8, True, False), (False, False, 8, True, 3))),  # FP8 codes through the e4m3 table (MXFP8: E8M0)
    *((_triton_int8._quant_int8_kernel,
       dict(x_ptr="*bf16", q_ptr="*i8", s_ptr=F32, z_ptr=I32, K="i32", stride_xm="i32", stride_qm="i32",
            stride_s="i32", half_range="fp32", min_scale="fp32"),
       dict(STATIC=static, ASYM=asym, BLOCK=1024), dict(num_warps=4, **NO_FMA))
      for static in (False, True) for asym in (False, True)),
    *((_triton_int8._int8_matmul_kernel,
       dict(x_ptr="*i8", w_ptr="*i8", y_ptr="*bf16", xs_ptr=F32, ws_ptr=F32, bias_ptr="*bf16", xz_ptr=I32,
            wsum_ptr=I32, M="i32", N="i32", K="i32", stride_xm="i32", stride_wn="i32", stride_ym="i32",
            stride_xs="i32", stride_ws="i32"),
       dict(HAS_BIAS=True, HAS_ZERO=zero, BLOCK_M=64, BLOCK_N=128, BLOCK_K=128),
       dict(num_warps=4, num_stages=3, **NO_FMA)) for zero in (False, True)),
    (_triton_llm_int8._llm_int8_matmul_kernel,
     dict(x_ptr="*bf16", xq_ptr="*i8", rs_ptr=F32, cols_ptr=F32, w_ptr="*i8", scb_ptr=F32, bias_ptr="*bf16",
          y_ptr="*bf16", M="i32", N="i32", K="i32", stride_xm="i32", stride_xqm="i32", stride_wn="i32",
          stride_ym="i32", int_scale="fp32", outlier_scale="fp32"),
     dict(HAS_BIAS=True, IEEE=False, BLOCK_M=64, BLOCK_N=128, BLOCK_K=64), dict(num_warps=4, num_stages=3, **NO_FMA)),
    (_triton_moe._grouped_gemm_kernel,
     dict(a_ptr="*bf16", w_ptr="*bf16", c_ptr="*bf16", sorted_ids_ptr=I64, block_expert_ptr=I64, rows="i32", N="i32",
          K="i32", a_row_div="i32", num_experts="i32", stride_am="i32", stride_we="i32", stride_wn="i32",
          stride_wk="i32", stride_cm="i32"),
     dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=64, IEEE=False, UPCAST=False), dict(num_warps=4, **NO_FMA)),
    *((_triton_moe._grouped_gemm_fp8_kernel,
       dict(a_ptr="*fp8e4nv", as_ptr=F32, w_ptr="*fp8e4nv", ws_ptr=F32, c_ptr="*bf16", sorted_ids_ptr=I64,
            block_expert_ptr=I64, rows="i32", N="i32", K="i32", a_row_div="i32", num_experts="i32", block_n="i32",
            block_k="i32", stride_am="i32", stride_asm="i32", stride_we="i32", stride_wn="i32", stride_wse="i32",
            stride_wsn="i32", stride_cm="i32"),
       dict(K_BLOCKED=blocked, BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, UPCAST=False), dict(num_warps=4, **NO_FMA))
      for blocked in (True, False)),
    (_triton_moe._grouped_gemm_int8_kernel,
     dict(a_ptr="*i8", as_ptr=F32, w_ptr="*i8", ws_ptr=F32, c_ptr="*bf16", sorted_ids_ptr=I64, block_expert_ptr=I64,
          rows="i32", N="i32", K="i32", a_row_div="i32", num_experts="i32", stride_am="i32", stride_asm="i32",
          stride_we="i32", stride_wn="i32", stride_wse="i32", stride_cm="i32"),
     dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=64), dict(num_warps=4, **NO_FMA)),
    *((_triton_moe_int4._grouped_gemm_int4_kernel,
       dict(a_ptr="*bf16", qw_ptr=I32, s_ptr="*u8" if scale_2 == 3 else "*fp8e4nv" if scale_2 else F32, z_ptr="*u8",
            gidx_ptr=I32, cb_ptr=F32,
            s2_ptr=F32, c_ptr="*bf16", sorted_ids_ptr=I64, block_expert_ptr=I64, rows="i32", N="i32", K="i32",
            group="i32", a_row_div="i32", num_experts="i32", stride_am="i32", stride_qe="i32", stride_qk="i32",
            stride_se="i32", stride_sg="i32", stride_ze="i32", stride_zg="i32", stride_ge="i32", stride_s2e="i32",
            stride_cm="i32"),
       dict(G_IDX=g_idx, BLOCK_M=16, BLOCK_N=64, BLOCK_K=64, UPCAST=False, IEEE=False, BITS=bits, CODEBOOK=codebook,
            SCALE_2=scale_2 % 3, E8M0=scale_2 == 3),
       dict(num_warps=4, **NO_FMA))
      for g_idx, bits, codebook, scale_2 in ((False, 4, False, 0), (True, 4, False, 0), (False, 8, False, 0),
                                             (False, 4, True, 0), (False, 4, True, 1), (False, 4, True, 2),
                                             (False, 4, True, 3), (False, 8, True, 0), (False, 8, True, 3))),
    *((_triton_mxfp8._mx_quant_kernel,
       dict(x_ptr="*bf16", y_ptr="*bf16", K="i32", stride_xm="i32", stride_ym="i32"),
       dict(RULE=rule, GROUPS=8), dict(num_warps=2, **NO_FMA)) for rule in (0, 1)),
    # Paged attention, bfloat16 queries over a bfloat16 or FP8 pool: the tensor-core path (the
    # interpreter runs the float32 one), with a window, soft-capping and gpt-oss's sinks.
    *((_triton_attention._extend_kernel,
       dict(q_ptr="*bf16", k_ptr=pool, v_ptr=pool, o_ptr=F32, r2t_ptr=I64, r2t_stride="i32", slots_ptr=I64,
            prefix_ptr=I64, ext_ptr=I64, starts_ptr=I64, q_stride_t="i32", q_stride_h="i32", k_stride_h="i32",
            k_stride_s="i32", o_stride_t="i32", o_stride_h="i32", scale="fp32", k_scale="fp32", v_scale="fp32",
            window="i32", softcap="fp32", sinks_ptr=F32, D="i32"),
       dict(GROUP=4, HAS_WINDOW=True, HAS_SOFTCAP=softcap, HAS_SINKS=sinks, BLOCK_M=32, BLOCK_N=32, BLOCK_D=64,
            IEEE=False), dict(num_warps=4, **NO_FMA))
      for pool, softcap, sinks in (("*bf16", False, False), ("*fp8e4nv", True, False), ("*bf16", False, True))),
    (_triton_attention._decode_split_kernel,
     dict(q_ptr="*bf16", k_ptr="*bf16", v_ptr="*bf16", part_ptr=F32, lse_ptr=F32, r2t_ptr=I64, r2t_stride="i32",
          slots_ptr=I64, prefix_ptr=I64, starts_ptr=I64, q_stride_t="i32", q_stride_h="i32", k_stride_h="i32",
          k_stride_s="i32", scale="fp32", k_scale="fp32", v_scale="fp32", window="i32", softcap="fp32", D="i32",
          H="i32"),
     dict(SPLITS=4, GROUP=4, HAS_WINDOW=True, HAS_SOFTCAP=False, BLOCK_G=16, BLOCK_N=32, BLOCK_D=64, IEEE=False),
     dict(num_warps=4, **NO_FMA)),
    *((_triton_attention._decode_merge_kernel,
       dict(part_ptr=F32, lse_ptr=F32, o_ptr=F32, starts_ptr=I64, sinks_ptr=F32, o_stride_t="i32", o_stride_h="i32",
            D="i32", H="i32"),
       dict(SPLITS=4, HAS_SINKS=sinks, BLOCK_S=4, BLOCK_D=64), dict(num_warps=4, **NO_FMA)) for sinks in (False, True)),
]


def main() -> None:
    target = GPUTarget("cuda", int(os.environ.get("CUDA_ARCH", "90")), 32)
    for fn, signature, constexprs, options in KERNELS:
        src = ASTSource(fn=fn, signature={**signature, **dict.fromkeys(constexprs, "constexpr")}, constexprs=constexprs)
        ptx = triton_compile(src, target=target, options=dict(options)).asm["ptx"]
        # tl.exp's fast path is a bare ex2.approx.f32; CUDA's expf (libdevice) uses the .ftz form.
        facts = {"fma": "fma.rn.f32" in ptx, "fast_exp": "ex2.approx.f32" in ptx,
                 # FP8 tensor-core MMAs; FP8 stores rounded to nearest even and saturated.
                 "fp8_mma": ".e4m3.e4m3" in ptx, "fp8_cvt_rn": "cvt.rn.satfinite.e4m3x2.f32" in ptx,
                 # int8 tensor-core MMAs; the int8 quantizer's round-half-even by 1.5 * 2^23 kept.
                 "int8_mma": ".s8.s8" in ptx, "rounder": "0f4B400000" in ptx}
        print(json.dumps({"kernel": fn.__name__, "ptx_chars": len(ptx), **facts}), flush=True)


if __name__ == "__main__":
    main()
