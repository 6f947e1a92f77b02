#!/usr/bin/env bash
# One lent GPU machine's session in one command (no network there; its image holds PyTorch,
# Triton, transformers): install the wheels benchmarks/gpu_wheels.sh fetched (carried as .whl/)
# and batonlm itself (editable, no dependencies, so `batonlm` is on the PATH for the tests that
# start a server), print the versions, then run benchmarks/gpu_check.sh's steps (GPU_CHECK_STEPS
# picks them; each under its own time limit) and copy their logs and JSON files to $OUT where
# that is set (one archive, gpu_results.tgz, and the summary). Here, before the call: benchmarks/gpu_wheels.sh. The call (device tool):
#   run(command="benchmarks/gpu_session.sh", carry=[".whl"], timeout_s=600)
#   GPU_CHECK_STEPS="tests quantization" benchmarks/gpu_session.sh   # first call (a call runs 10 minutes at most)
#   GPU_CHECK_STEPS="decode kernels spec models lora host" benchmarks/gpu_session.sh   # second
#   GPU_CHECK_STEPS="quantization_8b" benchmarks/gpu_session.sh   # a third, where device time is left
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
touch /tmp/gpu_session_start
if ls .whl/*.whl > /dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
"$PY" -m pip install -q --no-index --no-deps --no-build-isolation -e . || exit 1
"$PY" - <<'EOF' || exit 1
import torch, triton, transformers, batonlm, fastapi, zmq, xgrammar  # everything the server imports
print("torch", torch.__version__, "cuda", torch.version.cuda, "| triton", triton.__version__,
      "| transformers", transformers.__version__, "|", torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU")
EOF
export PYTHON="$PY"
benchmarks/gpu_check.sh
rc=$?
if [ -n "${OUT:-}" ]; then  # one archive (the tool returns at most 8 files): the step logs, the JSON written now
  find benchmarks/results -newer /tmp/gpu_session_start \( -name '*_gpu.json' -o -name 'gpu_check_*.log' \) -print0 |
    xargs -0 tar czf "$OUT/gpu_results.tgz"
  cp benchmarks/results/local/gpu_check_summary.txt "$OUT"/ 2>/dev/null
fi
exit $rc
