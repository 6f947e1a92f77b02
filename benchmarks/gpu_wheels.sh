#!/usr/bin/env bash
# Wheels for a GPU machine that cannot reach a package index (the lent H100 / H200 machines: see
# benchmarks/gpu_session.sh): what batonlm needs beyond what their image holds (PyTorch, Triton,
# transformers, tokenizers, safetensors, numpy, httpx, prometheus-client, pyyaml, tqdm, anyio,
# h11, click, pytest, ...), for CPython 3.12 on x86-64 Linux, into .whl/ (git-ignored through
# .git/info/exclude; about 9 MB). The versions are this machine's, so both sides run the same.
#   benchmarks/gpu_wheels.sh [python version, default 3.12]
set -euo pipefail
cd "$(dirname "$0")/.."
PYV="${1:-3.12}"
mkdir -p .git/info .whl
grep -qx "/.whl/" .git/info/exclude 2>/dev/null || echo "/.whl/" >> .git/info/exclude
version() { python3 -c "import importlib.metadata as m; print(m.version('$1'))"; }
for name in pyzmq pydantic pydantic-core annotated-types typing-inspection fastapi starlette opentelemetry-api \
            uvicorn msgspec orjson xgrammar apache-tvm-ffi; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PYV" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
    -d .whl "$name==$(version "$name")"
done
du -sh .whl
