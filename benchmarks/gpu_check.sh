#!/usr/bin/env bash
# Every GPU check in one go, for a machine with a CUDA device (about 5-8 minutes on one GPU):
#   tests      the tests marked `gpu` (only the files that have them are collected): compiled Triton
#              kernels (sampling, attention, FP8 / int8 / int4 GEMMs and MoE GEMMs, int8 with zero
#              points) against their torch references; the CUDA device path (streams, pinned copies,
#              transformers parity, overlap == normal); CUDA graphs == the eager step;
#   kernels    the kernel benchmark (benchmarks/results/kernels_gpu.json);
#   decode     the decode path (gpu_decode.json): greedy equality of Triton attention + CUDA graphs
#              with the torch path on stories260K (fp32) and a random 32M Llama (bf16), normal vs
#              overlap ITL at 1 / 8 / 64 streams, decode step vs the HBM roofline;
#   spec       speculative decoding on vs off (speculative_gpu.json);
#   models     the model families (models_gpu.json): the MoE layer's Triton grouped GEMM vs a
#              per-expert loop in bfloat16, decode tok/s per family at 1 and 16 streams;
#   lora       16 streams over 0 / 1 / 4 / 8 adapters (lora_mix_gpu.json);
#   quantization  bf16 vs FP8 vs static FP8 (AutoFP8) vs W8A8 int8 (symmetric and asymmetric
#              activations) vs int4 vs bitsandbytes NF4 and LLM.int8 vs NVFP4A16 decode tok/s and
#              the per-projection GEMMs on a random 32M Llama (quantization_gpu.json) and
#              a small Qwen3-MoE whose experts stay quantized (quantization_moe_gpu.json);
#   quantization_8b  bf16 vs FP8 vs int8 vs int4 on Llama-3-8B's shapes, 4 of its layers
#              (quantization_8b_gpu.json: a step of its own, it writes 7.6 GB of checkpoints first);
#   host       the host side next to the real device step (host_gpu.json);
#   tp         scale-out, where there are at least 2 GPUs (tp_sync_gpu.json): NCCL collective
#              costs, decode tokens/s at --tp 1/2, serving with --tp 2, --dp 2, DP attention.
# GPU_CHECK_STEPS (default: all, in this order) picks steps; each runs under its own time limit
# (GPU_CHECK_LIMIT seconds, default 300), logs to benchmarks/results/local/gpu_check_<step>.log,
# and a failing step does not stop the next: the summary (gpu_check_summary.txt) lists each
# step's exit status and seconds, and the script exits non-zero if any failed.
# Without a CUDA device the tests skip and the benchmarks say so.
#   benchmarks/gpu_check.sh [kernel benchmark args, e.g. --iters 20]
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python}"
export TRITON_INTERPRET=0
STEPS="${GPU_CHECK_STEPS:-tests kernels decode spec models lora quantization quantization_8b host tp}"
LIMIT="${GPU_CHECK_LIMIT:-300}"
LOGS=benchmarks/results/local
mkdir -p "$LOGS"
SUMMARY="$LOGS/gpu_check_summary.txt"
: > "$SUMMARY"
failed=0

step() {  # step NAME COMMAND...
  local name=$1 start rc
  shift
  start=$(date +%s)
  echo "== $name: $*"
  timeout "$LIMIT" "$@" 2>&1 | tee "$LOGS/gpu_check_$name.log"
  rc=${PIPESTATUS[0]}
  echo "$name rc=$rc seconds=$(( $(date +%s) - start ))" | tee -a "$SUMMARY"
  [ "$rc" -eq 0 ] || failed=1
}

for s in $STEPS; do
  case $s in
    tests) mapfile -t files < <(grep -rl --include='test_*.py' "pytest.mark.gpu" tests | sort)
           step tests "$PY" -m pytest -m gpu "${files[@]}" -q -rs -p no:cacheprovider ;;
    kernels) step kernels "$PY" benchmarks/kernels_gpu.py --out benchmarks/results/kernels_gpu.json "$@" ;;
    decode) step decode "$PY" benchmarks/gpu_decode.py --output-json benchmarks/results/gpu_decode.json ;;
    spec) step spec "$PY" benchmarks/speculative.py --rounds 3 --json benchmarks/results/speculative_gpu.json ;;
    models) step models "$PY" benchmarks/models.py --device cuda --dtype bfloat16 --json benchmarks/results/models_gpu.json ;;
    lora) step lora "$PY" benchmarks/lora_mix.py --device cuda --dtype bfloat16 --output-json benchmarks/results/lora_mix_gpu.json ;;
    quantization)
      step quantization "$PY" benchmarks/quantization.py --device cuda --dtype bfloat16 --json benchmarks/results/quantization_gpu.json
      step quantization_moe "$PY" benchmarks/quantization.py --device cuda --dtype bfloat16 --shape qwen3-moe --batch 1 16 \
        --json benchmarks/results/quantization_moe_gpu.json ;;
    quantization_8b)  # Llama-3-8B's layer shapes (4096 -> 14336, 128256 vocabulary) in 4 of its 32 layers:
      # Part 1 is the 8B's GEMMs; Part 2 serves bf16 vs FP8 blocks vs int8 vs int4 (the 8B's per-layer decode cost)
      step quantization_8b "$PY" benchmarks/quantization.py --device cuda --dtype bfloat16 --shape llama3-8b --layers 4 \
        --rounds 2 --only float "fp8 W8A8 block" "int8 W8A8" "gptq int4" --json benchmarks/results/quantization_8b_gpu.json ;;
    host) step host "$PY" benchmarks/host_overhead.py --device cuda --quick --streams 1 64 256 --json benchmarks/results/host_gpu.json ;;
    tp) if [ "$("$PY" -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ]; then
          step tp "$PY" benchmarks/tp_sync.py --device cuda --tp 1 2 --json benchmarks/results/tp_sync_gpu.json
        fi ;;
    *) echo "unknown step $s (steps: tests kernels decode spec models lora quantization quantization_8b host tp)"; exit 2 ;;
  esac
done
echo "== summary"; cat "$SUMMARY"
exit $failed
