#!/usr/bin/env bash
# Every GPU check in one go, for a machine with a CUDA device:
#   1. the tests marked `gpu` (compiled Triton kernels against their torch references; the CUDA
#      device path: streams, pinned copies, transformers parity, overlap == normal);
#   2. the kernel benchmark (writes benchmarks/results/kernels_gpu.json);
#   3. the overlap benchmark on the GPU (writes benchmarks/results/overlap_gpu.json).
# Without a CUDA device the tests skip and the kernel benchmark says so.
#   benchmarks/gpu_check.sh [kernel benchmark args, e.g. --iters 20]
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python}"
export TRITON_INTERPRET=0
"$PY" -m pytest -m gpu tests -q -rs -p no:cacheprovider
"$PY" benchmarks/kernels_gpu.py "$@"
if "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    "$PY" benchmarks/overlap.py --output-json benchmarks/results/overlap_gpu.json
fi
