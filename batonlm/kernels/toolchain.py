"""Where compiled code comes from on the CPU: the C++ compiler (the one inductor would use), the
per-user cache that inductor's graphs and batonlm's own kernels are built into, and the build of
a kernel's shared library (`cpu_attention.cpp`, `cpu_linear.cpp`)."""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

logger = logging.getLogger(__name__)

FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC"]


def cxx_compiler() -> str | None:
    """The C++ compiler inductor would use on the CPU, if there is one."""
    for name in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if name and shutil.which(name):
            return name
    return None


def cache_root() -> Path:
    """$XDG_CACHE_HOME/batonlm (~/.cache/batonlm): compiled graphs and kernels, kept across runs."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "batonlm"


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def build_library(source: Path) -> Path:
    """`source`'s shared library (-O3 -march=native, OpenMP: torch's runtime, which the process
    has loaded under the same soname), compiled into the cache the first time on this machine and
    kept by source, compiler and CPU flags. RuntimeError (or OSError) when it cannot be built."""
    cxx = cxx_compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler (g++, c++ or clang++; or $CXX)")
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=True).stdout
    key = hashlib.sha256("\n".join([source.read_text(), cxx, version, *FLAGS, _cpu_flags()]).encode()).hexdigest()[:16]
    out_dir = cache_root() / "kernels"
    target = out_dir / f"{source.stem}-{key}.so"
    if target.exists():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out_dir, suffix=".so")
    os.close(fd)
    try:
        done = subprocess.run([cxx, *FLAGS, str(source), "-o", tmp], capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{cxx} failed: {done.stderr.strip()[-2000:]}")
        os.replace(tmp, target)  # whole or not at all: another process may be building it too
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def load_kernel(source: Path, symbol: str, argtypes: list, instead: str) -> Callable[..., None] | None:
    """`symbol` of `source`'s library (built the first time), its C signature set; None, with one
    warning saying what runs `instead`, where it cannot be built or loaded."""
    try:
        fn = getattr(ctypes.CDLL(str(build_library(source))), symbol)
    except (OSError, RuntimeError, AttributeError, subprocess.SubprocessError) as e:
        logger.warning("the CPU kernel %s could not be built (%s): %s", source.name, e, instead)
        return None
    fn.argtypes = argtypes
    fn.restype = None
    return fn
