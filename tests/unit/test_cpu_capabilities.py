"""The numerical tests hold whatever vector width the CPU has: rerun them with torch pinned to
AVX2 and to no SIMD at all (on this machine, whatever it is), as a machine of another CPU family
would run them. Their tolerances come from error bounds, not from one machine's results."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NUMERICAL = ["tests/kernels/test_logprob_kernels.py", "tests/unit/test_sampling_reference.py",
             "tests/unit/test_torch_attention.py"]


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86-64 vector widths")
@pytest.mark.parametrize("capability", ["avx2", "default"])
def test_numerical_tests_pass_at_another_vector_width(capability):
    env = {**os.environ, "ATEN_CPU_CAPABILITY": capability}
    check = subprocess.run([sys.executable, "-c", "import torch; print(torch.backends.cpu.get_cpu_capability())"],
                           env=env, capture_output=True, text=True, timeout=120)
    if check.stdout.strip().lower() != capability:
        pytest.skip(f"this CPU has no {capability}")
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *NUMERICAL],
                         env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
