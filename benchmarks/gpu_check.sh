#!/usr/bin/env bash
# Every GPU check in one go, for a machine with a CUDA device (about 5-8 minutes on one GPU):
#   1. the tests marked `gpu`: compiled Triton kernels (sampling, attention) against their torch
#      references; the CUDA device path (streams, pinned copies, transformers parity, overlap ==
#      normal); CUDA graphs == the eager step (fp32 tokens, bf16 logits);
#   2. the kernel benchmark (writes benchmarks/results/kernels_gpu.json);
#   3. the decode path (writes benchmarks/results/gpu_decode.json): greedy equality of Triton
#      attention + CUDA graphs with the torch path on stories260K (fp32) and a random 32M Llama
#      (bf16), normal vs overlap ITL at 1 / 8 / 64 streams, decode step vs the HBM roofline;
#   4. speculative decoding on vs off (writes benchmarks/results/speculative_gpu.json): the
#      verification step's cost on a GPU, where its rows run in one CUDA graph replay;
#   5. the model families (writes benchmarks/results/models_gpu.json): the MoE layer's Triton
#      grouped GEMM vs a per-expert loop in bfloat16, decode tok/s per family at 1 and 16 streams;
#      LoRA: 16 streams over 0 / 1 / 4 / 8 adapters (writes benchmarks/results/lora_mix_gpu.json);
#   6. quantized weights (writes benchmarks/results/quantization_gpu.json, and
#      quantization_moe_gpu.json for a small Qwen3-MoE whose experts stay quantized): bf16 vs FP8
#      vs static FP8 (AutoFP8) vs W8A8 int8 vs int4 decode tok/s; the host side next to the real device step
#      (benchmarks/results/host_gpu.json): main-process CPU per token and scheduler CPU per iteration against the iteration's time;
#   7. scale-out, where there are at least 2 GPUs (writes benchmarks/results/tp_sync_gpu.json):
#      NCCL collective costs, decode tokens/s at --tp 1/2, and serving with --tp 2, --dp 2 and
#      --dp 2 --enable-dp-attention (the `gpu` tests above check their tokens; docs/distributed.md).
# Without a CUDA device the tests skip and the benchmarks say so.
#   benchmarks/gpu_check.sh [kernel benchmark args, e.g. --iters 20]
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python}"
export TRITON_INTERPRET=0
"$PY" -m pytest -m gpu tests -q -rs -p no:cacheprovider
"$PY" benchmarks/kernels_gpu.py --out benchmarks/results/kernels_gpu.json "$@"
"$PY" benchmarks/gpu_decode.py --output-json benchmarks/results/gpu_decode.json
"$PY" benchmarks/speculative.py --rounds 3 --json benchmarks/results/speculative_gpu.json
"$PY" benchmarks/models.py --device cuda --dtype bfloat16 --json benchmarks/results/models_gpu.json
"$PY" benchmarks/lora_mix.py --device cuda --dtype bfloat16 --output-json benchmarks/results/lora_mix_gpu.json
"$PY" benchmarks/quantization.py --device cuda --dtype bfloat16 --json benchmarks/results/quantization_gpu.json
"$PY" benchmarks/quantization.py --device cuda --dtype bfloat16 --shape qwen3-moe --batch 1 16 \
  --json benchmarks/results/quantization_moe_gpu.json
"$PY" benchmarks/host_overhead.py --device cuda --quick --streams 1 64 256 --json benchmarks/results/host_gpu.json
if [ "$("$PY" -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ]; then
  "$PY" benchmarks/tp_sync.py --device cuda --tp 1 2 --json benchmarks/results/tp_sync_gpu.json
fi
