"""The numerical tests hold whatever vector width the CPU has: rerun them with torch pinned to
AVX2 and to no SIMD at all (on this machine, whatever it is), as a machine of another CPU family
would run them. Their tolerances come from error bounds, not from one machine's results.

The width changes how torch sums and vectorises, not what a test checks, so one representative
test per family reruns (the rest of each file runs at the native width in the suite itself): the
logprobs kernel and its reference over the largest vocabulary (the longest sums) with 20
alternatives; torch attention with a sliding window over mixed prefills and decodes; the sampler's
filter thresholds (hand-computed boundaries) and its batch invariance (a seeded row draws the same
token alone and in any batch)."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NUMERICAL = [
    "tests/kernels/test_logprob_kernels.py::test_kernel_equals_the_reference[20-151936]",
    "tests/unit/test_torch_attention.py::test_mixed_prefills_and_decodes_match_per_request_attention[5]",
    "tests/unit/test_sampling_reference.py::test_keep_mask_hand_computed",
    "tests/unit/test_sampling_reference.py::test_seeded_row_draws_the_same_token_alone_and_in_any_batch",
]


# One interpreter: check that torch took the width, then run the tests (without plugins: the
# representatives need none, and loading schemathesis and hypothesis takes longer than they do).
RUN = """
import sys, torch, pytest
if torch.backends.cpu.get_cpu_capability().lower() != sys.argv[1]:
    sys.exit(77)
sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", *sys.argv[2:]]))
"""


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86-64 vector widths")
@pytest.mark.parametrize("capability", ["avx2", "default"])
def test_numerical_tests_pass_at_another_vector_width(capability):
    env = {**os.environ, "ATEN_CPU_CAPABILITY": capability, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
    out = subprocess.run([sys.executable, "-c", RUN, capability, *NUMERICAL],
                         env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    if out.returncode == 77:
        pytest.skip(f"this CPU has no {capability}")
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert f"{len(NUMERICAL)} passed" in out.stdout, out.stdout[-4000:]  # none skipped
