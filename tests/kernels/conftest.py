"""Kernel tests run the Triton kernels under the interpreter on the CPU (see TESTING.md).

triton.jit picks interpreting or compiling when a kernel is defined, so TRITON_INTERPRET must be
set before that; batonlm defines its kernels on first use, so setting it here is early enough.
Where CUDA is present it is left unset: the kernels compile, the `gpu` tests check them, and the
engine's tests in the same session run compiled kernels rather than interpreted ones.
"""

import os
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_configure(config):
    common = sys.modules.get("batonlm.kernels._triton_common")
    if common is not None and common.INTERPRET != (os.environ.get("TRITON_INTERPRET") == "1"):
        raise RuntimeError("batonlm's Triton kernels were defined before TRITON_INTERPRET was set")
